"""Reading files: the lazy view (:mod:`.store`: :class:`Store`, :class:`TensorHandle`), the read
planner behind it (:mod:`.tensors`: one tensor or slice; :mod:`.many`: loads, streams, batched
fetches and device staging of many), and ``select=`` (:mod:`.select`). Importing this package
imports none of them.
"""
