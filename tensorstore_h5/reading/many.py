"""Reading many tensors of an open file at once: loads (into new tensors, mappings or device
memory), streams one tensor at a time, fills of existing targets (``load_into``), and parts
of several tensors; over a URL, the bytes of the next tensors are fetched in batches while
the current ones are read, and to devices many tensors share each staging buffer.

:class:`Reader` is the read planner behind :class:`~tensorstore_h5.reading.store.Store`: the
store resolves ``select=`` and keys into entries, the reader decides how their bytes are read.
"""

from __future__ import annotations

import os
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from ..format.layout import ArrayEntry, Container, Contiguous, TensorEntry
from ..format.slicing import Selection, whole
from ..format.tree import Leaf
from ..storage import Deferred, files, memory, parallel
from .tensors import TensorReader, checking, data_bytes

if TYPE_CHECKING:
    from ..display import Progress
    from ..transfer import Device

remote: Any = Deferred(f"{__package__.rpartition('.')[0]}.storage.remote", globals(), "remote")  # URLs only
transfer: Any = Deferred(f"{__package__.rpartition('.')[0]}.transfer", globals(), "transfer")  # device loads only

__all__ = ["Reader"]


class Reader(TensorReader):
    """The reads of a store: those of :class:`TensorReader`, and of many tensors at once."""

    def items(self, entries: list[Any], device: Device, mmap: bool, verify: bool | None) -> Iterator[tuple[str, Any]]:
        """``(key path, value)`` of each leaf entry, read one at a time (see ``Store.items``)."""
        alive: weakref.WeakValueDictionary[str, torch.Tensor] = weakref.WeakValueDictionary()
        fmap = files.FileMap(self.rawfile(), whole=False) if mmap else None  # each tensor unmapped when dropped
        if not self.local:  # batches fetched ahead, not one round trip per tensor
            device = transfer.asked_once(device)
            for group, filled in self._fetched(entries, self._streamable(device)):
                for entry in group:
                    memory.streamed(data_bytes(entry))
                    value = self.read_leaf(entry, alive, device, fmap, None, verify, filled.pop(entry.path, None))
                    yield entry.path, value
                    del value  # not held while the next one is read
            return
        advised, ahead = 0, 0  # entries[:advised] were handed to the kernel's readahead; bytes beyond now
        sizes: dict[int, int] = {}  # bytes handed to the readahead, by entry, until the entry is read
        for i, entry in enumerate(entries):
            if fmap is None and files.READAHEAD_BYTES:  # the disk reads the next tensors while this one is used
                ahead -= sizes.pop(i, 0)
                advised = max(advised, i)
                while advised < len(entries) and ahead < files.READAHEAD_BYTES:
                    ranges = self.ranges(entries[advised])
                    if ranges:
                        self.rawfile().willneed(ranges)
                        sizes[advised] = n = sum(n for _, n in ranges)
                        ahead += n
                    advised += 1
            memory.streamed(data_bytes(entry))  # what the caller freed since the last one goes back
            yield entry.path, self.read_leaf(entry, alive, device, fmap, None, verify)

    def read_many(self, parts: list[tuple[str, TensorEntry, Selection]], verify: bool | None = None
                  ) -> dict[str, torch.Tensor]:
        """``{key: new CPU tensor}`` for ``(key, entry, selection)`` parts, checked as
        :func:`checking` says; over a URL every range they touch is fetched at once (see
        ``Store.read_many``)."""
        raw = self.rawfile()
        try:
            if not self.local:
                with self.fetching([key for key, _, sel in parts if not sel.empty]):
                    raw.prefetch([r for _, entry, sel in parts if not sel.empty for r in self.ranges(entry, sel)])
            return {key: self.read_tensor(entry, sel, None, restore_layout=False, verify=checking(verify, sel.full))
                    for key, entry, sel in parts}
        finally:
            raw.release()

    def walk(self, entries: list[Any], verify: bool | None) -> Iterator[Container | Leaf]:
        """Containers and leaves of ``entries`` in pre-order, each leaf read when it is reached
        (see ``Store.walk``)."""
        tied = {e.same_as for e in entries if isinstance(e, TensorEntry) and e.same_as is not None}
        alive: weakref.WeakValueDictionary[str, torch.Tensor] = weakref.WeakValueDictionary()
        kept: dict[str, torch.Tensor] = {}  # tensors that a later key is tied to: one object for both
        for group, filled in self._fetched(entries, self._streamable(None)):  # over a URL: batches ahead, as items()
            for entry in group:
                if isinstance(entry, Container):
                    yield entry
                else:
                    value = self.read_leaf(entry, alive, None, None, None, verify, filled.pop(entry.path, None))
                    if entry.path in tied:
                        kept[entry.path] = value
                    yield Leaf(entry.path, entry.key, value)
                    del value  # not held while the next leaf is read

    def load(self, entries: list[Any], device: Device, progress: bool | None, mmap: bool, verify: bool | None
             ) -> list[Container | Leaf]:
        """Containers and read leaves of ``entries``, for ``tree.inflate`` (see ``Store.load``;
        ``verify`` as :meth:`read_leaf` takes it)."""
        cache: dict[str, torch.Tensor] = {}
        items: list[Container | Leaf] = []
        fmap = files.FileMap(self.rawfile()) if mmap else None
        cold = False
        if self.local:
            ranges = [r for e in entries for r in self.ranges(e)]
            cold = not self.rawfile().cached(ranges)  # then more reads in flight (parallel.COLD_IO_THREADS)
            if mmap:
                if cold:  # the caller's page faults will read the mapped tensors: let them read ahead
                    self.rawfile().prime(ranges)
            elif files.READAHEAD_BYTES:  # from a cold cache the kernel reads ahead of the I/O threads
                self.rawfile().willneed(ranges)
        staged: dict[str, torch.Tensor] = {}
        if device is not None:
            device = transfer.asked_once(device)
        direct = self._streamable(device)
        with self._batched(progress, sum(data_bytes(e) for e in entries), cold) as (bar, plan):
            if device is not None and self.local and transfer.batched():  # to devices: many tensors per buffer
                pairs = [(e, transfer.device_empty(e.shape, e.dtype.torch_dtype, d, e.path)) for e in entries
                         if (d := self._stageable(e, device)) is not None]
                unchecked = self._stage_many(pairs, lambda e: bar.update(data_bytes(e)), check=verify is not False)
                staged = {e.path: t for e, t in pairs}
                if verify is not False:  # bytes not checked in the staging buffers: read once more and hashed
                    self.verify_many(unchecked)
            for group, filled in self._fetched(entries, direct):
                for entry in group:
                    if isinstance(entry, Container):
                        items.append(entry)
                    else:
                        leaf = self.read_leaf(entry, cache, device, fmap, plan, False if entry.path in staged else verify,
                                              staged.get(entry.path, filled.get(entry.path)))
                        items.append(Leaf(entry.path, entry.key, leaf))
                        if entry.path not in staged:
                            bar.update(data_bytes(entry))
        return items

    def _streamable(self, device: Device) -> Callable[[Any], bool] | None:
        """For a remote source, which entries :meth:`_fetched` streams into new CPU tensors of
        their own (contiguous tensors of at least :data:`remote.DIRECT_BYTES` bound for the
        CPU); None for other sources."""
        if not self.rawfile().remote:
            return None

        def direct(e: Any) -> bool:
            return isinstance(e, TensorEntry) and e.same_as is None and e.nbytes >= remote.DIRECT_BYTES and \
                isinstance(self.where(e), Contiguous) and self.target(device, e.path) is None
        return direct

    def _stageable(self, entry: Any, device: Device) -> torch.device | None:
        """The device that ``entry`` goes to through :meth:`_stage_many` (a contiguous dataset of
        a local file with bytes, not an alias, bound for memory that is not the CPU's), else None."""
        if not isinstance(entry, TensorEntry) or entry.same_as is not None or not entry.nbytes:
            return None
        target = self.target(device, entry.path)
        if target is None or not isinstance(self.where(entry), Contiguous):
            return None
        return target

    def _stage_many(self, pairs: list[tuple[TensorEntry, torch.Tensor]], done: Callable[[TensorEntry], None],
                    check: bool = False) -> list[TensorEntry]:
        """Fill each contiguous device tensor with its entry's stored bytes (shapes and dtypes
        already match) through the staging buffers of its device, many tensors per buffer
        (:meth:`transfer.Stager.copy_many`). ``done(entry)`` as each one's copies are issued.
        ``check``: check the stored checksums in the staging buffers as the bytes arrive, so
        they are read once (a device load's default; the tensors are new, so one that fails
        changes nothing the caller holds). Returns the entries it could not check that way
        (checksum blocks larger than a staging buffer), for :meth:`verify_many`. Raises
        FormatError naming the key for a read that fails or bytes whose checksum differs."""
        raw = self.rawfile()
        of = {id(t): e for e, t in pairs}  # dest -> entry, for done
        unchecked: list[TensorEntry] = []

        def filler(entry: TensorEntry, stager: transfer.Stager) -> transfer.FileFill:
            where = self.where(entry)
            assert isinstance(where, Contiguous)
            run = lambda job: self.keyed(job, entry)()  # noqa: E731
            if check and where.hashes is not None:
                if where.block <= stager.block_bytes:
                    return transfer.FileFill(raw, where.offset, run, where.hashes, where.block)
                unchecked.append(entry)
            return transfer.FileFill(raw, where.offset, run)

        for dev in dict.fromkeys(t.device for _, t in pairs):
            stager = self._stagers[dev]
            mine = [(t, filler(e, stager)) for e, t in pairs if t.device == dev]
            stager.copy_many(mine, lambda t: done(of[id(t)]))
        return unchecked

    def _fetched(self, entries: list[Any], direct: Callable[[Any], bool] | None = None
                 ) -> Iterator[tuple[list[Any], dict[str, torch.Tensor]]]:
        """``entries`` in groups whose stored bytes a remote source has fetched (about
        :data:`remote.BATCH_BYTES` a group, neighbouring ranges in one request); the next
        groups' bytes (:data:`remote.FETCH_AHEAD` of them) download while the caller reads the
        current one. One group, nothing fetched, for a local file.

        Each group comes with ``{path: tensor}``: a new CPU tensor holding the whole stored
        bytes of each entry that ``direct(entry)`` chose (a contiguous dataset), filled by
        the fetch itself rather than copied from fetched bytes."""
        if self.local:
            yield entries, {}
            return
        raw = self.rawfile()
        groups: list[tuple[list[Any], list[tuple[int, int]], list[TensorEntry]]] = [([], [], [])]
        size = 0
        for entry in entries:
            streamed = direct is not None and direct(entry)
            more = self.ranges(entry)
            grow = sum(n for _, n in more)
            limit = min(remote.BATCH_BYTES, remote.FIRST_BATCH_BYTES << (len(groups) - 1))  # see FIRST_BATCH_BYTES
            if groups[-1][0] and size and size + grow > limit:
                groups.append(([], [], []))
                size = 0
            groups[-1][0].append(entry)
            (groups[-1][2].append(entry) if streamed else groups[-1][1].extend(more))
            size += grow

        populate = raw.populate  # no faults under the GIL where one event loop receives (fsspec's aiohttp)

        def alloc(streamed: list[TensorEntry]) -> dict[str, torch.Tensor]:
            return {e.path: self.empty(e, e.shape, populate=populate) for e in streamed}

        def fetch(ranges: list[tuple[int, int]], streamed: list[TensorEntry], filled: dict[str, torch.Tensor] | None
                  ) -> tuple[list[tuple[int, bytes]], dict[str, torch.Tensor]]:
            filled = alloc(streamed) if filled is None else filled
            into = []
            for e in streamed:
                where = self.where(e)
                assert isinstance(where, Contiguous)
                into.append((where.offset, memory.tensor_buffer(filled[e.path])))
            return raw.fetch(ranges, into), filled

        ahead = max(1, remote.FETCH_AHEAD)
        pool = ThreadPoolExecutor(ahead, thread_name_prefix="th5-fetch")
        pending = deque(pool.submit(fetch, ranges, streamed, None) for _, ranges, streamed in groups[:ahead])
        try:
            for k, (group, _, _) in enumerate(groups):
                # The memory of the next group's streamed tensors (new tensors of the result, not
                # extra memory) is made here, while the earlier groups' requests are in flight:
                # made in the fetch thread, no request of that group was in flight for the ~40 ms
                # of faulting in 64 MiB (at 20 ms latency, a gap after every pair of batches).
                later = groups[k + ahead] if k + ahead < len(groups) else None
                made = alloc(later[2]) if later is not None else None
                with self.fetching([e.path for e in group if isinstance(e, (TensorEntry, ArrayEntry))]):
                    pieces, filled = pending.popleft().result()
                if later is not None:
                    pending.append(pool.submit(fetch, later[1], later[2], made))
                del made
                raw.use(pieces)
                del pieces
                yield group, filled
                del filled
        finally:
            for f in pending:
                f.cancel()
            pool.shutdown(wait=True)
            raw.release()

    def read_into(self, pairs: list[tuple[TensorEntry, torch.Tensor]], progress: bool | None, verify: bool | None
                  ) -> None:
        """Fill each target from its entry (shapes already checked; a target of another dtype
        is filled through a temporary of the stored dtype, cast like ``copy_``).

        Every dataset is checked first (storage, type, shape, byte range inside the file),
        and unless ``verify`` is False every checksum (:meth:`verify_many`: one more pass over
        the bytes, hashed on the I/O threads), so a damaged file is refused before any target
        changes. Over a URL the default (None) checks each batch's fetched bytes before that
        batch's targets are written, rather than fetching everything twice (True does).
        """
        for entry, _ in pairs:
            self.where(entry)
        if verify is True or (verify is None and self.local):
            self.verify_many([e for e, _ in pairs])
        targets = {id(e): t for e, t in pairs}
        with self._batched(progress, sum(e.nbytes for e, _ in pairs)) as (bar, plan):
            on_device = [(e, t) for e, t in pairs if self.staged(t.device)] if self.local else []
            if on_device and transfer.batched():  # device targets: many tensors per staging buffer
                staged = [(e, t) for e, t in on_device if t.is_contiguous() and e.nbytes and
                          t.dtype == e.dtype.torch_dtype and isinstance(self.where(e), Contiguous)]
                self._stage_many(staged, lambda e: bar.update(e.nbytes))
                done = {id(e) for e, _ in staged}
                pairs = [(e, t) for e, t in pairs if id(e) not in done]
            for group, _ in self._fetched([e for e, _ in pairs]):
                if verify is None and not self.local:
                    self.verify_many(group)  # the batch's fetched bytes, before its targets change
                for entry in group:
                    target = targets[id(entry)]
                    sel = whole(entry.shape)
                    if target.dtype == entry.dtype.torch_dtype:
                        self.read_tensor(entry, sel, target, restore_layout=False, plan=plan)
                    else:
                        value = self.read_tensor(entry, sel, None, restore_layout=False)
                        with torch.no_grad():
                            target.copy_(value)
                    bar.update(entry.nbytes)

    @contextmanager
    def _batched(self, progress: bool | None, nbytes: int, cold: bool = False
                 ) -> Iterator[tuple[Progress, parallel.ReadPlan | None]]:
        """``(bar, plan)`` for a multi-tensor read: a progress bar over ``nbytes``, and one read
        plan for both cores when no bar is shown (reads then finish at the end of the block;
        with a bar each tensor is read as it comes, so the bar moves); ``cold`` (the bytes are
        not in the page cache): the plan keeps :data:`parallel.COLD_IO_THREADS` reads in flight. An
        error inside the block abandons the plan's queued reads; the bar is closed either way."""
        from ..display import Progress  # (a slice or one tensor read shows no bar)

        bar = Progress(progress, desc=f"loading {os.path.basename(self.path)}")
        bar.total(nbytes)
        threads = parallel.COLD_IO_THREADS if cold else None
        plan = parallel.ReadPlan(self.rawfile(), threads) if bar.silent and self.local else None
        try:
            yield bar, plan
            if plan is not None:
                self.run(plan)
        except BaseException:
            if plan is not None:
                plan.abandon()
            raise
        finally:
            bar.close()
