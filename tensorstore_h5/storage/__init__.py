"""Where bytes come from and go: local files (:mod:`.files`: preadv, pwrite, O_DIRECT, mappings),
host memory for tensors (:mod:`.memory`), the I/O threads and read plans (:mod:`.parallel`),
URLs and file objects (:mod:`.remote`, over the client :mod:`.httpranges`), and files that
only libhdf5 reads (:mod:`.libhdf5`). Importing this package imports none of them.
"""
