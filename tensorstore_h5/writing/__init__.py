"""Writing files: :mod:`.writer` (:class:`Writer`, atomic :func:`save`) and :mod:`.background`
(:func:`save_async`). Importing this package imports neither.
"""
