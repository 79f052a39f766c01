"""The Llama forward pass on llama.cpp, through llama-cpp-python's bindings of its C API.

Same contract as model.LlamaModel: `forward(items)` runs every new token of every item through
one `llama_decode` (several when a step carries more than `n_batch` tokens, or an item longer
than a ubatch) and returns the logits of each item's last new token; `release(slot)` forgets the
slot's KV cells. A slot is a llama.cpp sequence id. The KV cache is not unified: each sequence has
a stream of its own, so a sequence attends only to its own cells (work proportional to its
length, not to the whole batch's).

What a sequence's logits depend on (the CPU; a GPU's kernels depend on the whole batch): the
weights' products are computed row by row (a row's result is the same in any batch), but
attention is not. llama.cpp cuts a batch into ubatches that take the same number of tokens from
each sequence in them (ubatch_rows), and its attention runs a tiled kernel for a sequence with 64
or more rows in a ubatch, row by row below, and, for a lone row of a lone sequence attending to
512 cells or more (past position 255), a kernel that splits the cells between the threads; the
three round differently. So a sequence's logits are the same alone or beside any other rows while
its prompt has fewer than 64 tokens and it holds fewer than 256 positions; beyond that, a prompt
prefilled beside other rows (its ubatches then carry fewer of its rows), or a long sequence
decoded alone rather than beside another row or with other thread counts, may differ in the last
bits. (llama-server says the same of its batches.) Neither is avoided: one llama_decode per such
prompt costs a pass over the weights for each, and a throwaway row beside a lone long decode row
(which would keep it off the split kernel) a third or more of batch-1 decode speed
(docs/operators/tuning.md, "What is bit for bit the same"). What each new position was computed
with is recorded (`last_tiled`) for the prefix cache, whose reuse must compute what a cold prefill
would.

Tokenization, sampling and stop handling stay in step_engine.py, shared with the numpy model:
llama.cpp is only asked for logits. On a GPU build of llama.cpp (`GGML_CUDA=on`) the same code
runs the model on the GPU when `gpu_layers` is not 0; a CPU build refuses that (GpuOffloadUnavailable)
rather than quietly running on the CPU.
"""

from __future__ import annotations

import bisect
import ctypes
import logging
import os
import sys
import threading
import time
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

import llama_cpp as lc

from .model import BatchItem, StepInterrupted
from .thread_governor import ThreadGovernor

_backend_lock = threading.Lock()
_backend_initialised = False
_GGML_LOG_WARN, _GGML_LOG_ERROR = 3, 4
# Standard logging: Triton's image runs this module without structlog (triton-local renders it).
log = logging.getLogger("sluice.triton_local.engine")


# What llama.cpp logs when a decode stops because we interrupted it (StepInterrupted): expected, not news.
_INTERRUPT_LOG_LINES = (b"removing memory module entries", b"failed to decode, ret = 2")


@lc.llama_log_callback
def _log_warnings_only(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    """llama.cpp logs every tensor and setting at load: pass on warnings and errors only."""
    if level in (_GGML_LOG_WARN, _GGML_LOG_ERROR) and not any(line in text for line in _INTERRUPT_LOG_LINES):
        sys.stderr.write(text.decode("utf-8", "replace"))


def init_backend_once() -> None:
    global _backend_initialised
    with _backend_lock:
        if not _backend_initialised:
            lc.llama_log_set(_log_warnings_only, ctypes.c_void_p(0))
            lc.llama_backend_init()
            _backend_initialised = True


# How long an interrupt ask that found no forward pass running waits for the next (_InterruptFlag):
# a round request's way in from the adapter takes a few milliseconds, and a busy box stalls it more.
ASK_KEPT_S = 0.2


class _InterruptFlag:
    """A flag llama.cpp's compute thread reads after every node of the graph, in C.

    llama.cpp stops a decode midway when its abort callback returns true, and its CPU backend calls
    the callback after each of a step's hundreds of graph nodes. A Python callback would take the
    GIL that often (and wait for it behind Triton's threads), so the callback is libc's `strlen`
    over a two-byte buffer we own: it returns 0 (false) while the first byte is 0 and 1 (true) once
    it is set, which is exactly the bool the callback returns, and it runs without Python.
    Armed only around the forward passes that may be interrupted, under a lock, so that an interrupt
    asked while one runs can never stop the one after it.

    An ask that finds no forward pass running may be kept for the next one, for ASK_KEPT_S: the ask
    (a request of its own) can reach the engine before the round it is for, or while that round's
    step is still being planned, and the step would then run to its end (seen: an interactive
    arrival waiting 110 ms for a bulk step its ask had missed by a few). The next forward pass
    takes it: an interruptible one stops before it starts, any other forgets it (the ask was for
    bulk work that has ended; what follows is the arrival's own step).
    """

    def __init__(self) -> None:
        self._buffer = ctypes.create_string_buffer(2)
        self._lock = threading.Lock()
        self._armed = False
        self._asked_at: float | None = None
        self.callback = ctypes.cast(ctypes.CDLL(None).strlen, lc.ggml_abort_callback)
        self.data = ctypes.cast(self._buffer, ctypes.c_void_p)

    def arm(self) -> bool:
        """Arms the flag for an interruptible forward pass; whether an ask already waits for it
        (then the pass must not start)."""
        with self._lock:
            asked = self._take_ask()
            self._buffer[0] = b"\x00"
            self._armed = not asked
            return asked

    def forget(self) -> None:
        """A forward pass that cannot be interrupted starts: an ask kept until now was for none."""
        with self._lock:
            self._asked_at = None

    def disarm(self) -> None:
        with self._lock:
            self._armed = False
            self._buffer[0] = b"\x00"

    def set(self, keep: bool = False) -> bool:
        """Stops the armed forward pass, if one runs; whether one did. Else, with `keep`, the ask
        waits for the next forward pass."""
        with self._lock:
            if self._armed:
                self._buffer[0] = b"\x01"
            elif keep:
                self._asked_at = time.monotonic()
            return self._armed

    def _take_ask(self) -> bool:
        asked = self._asked_at is not None and time.monotonic() - self._asked_at <= ASK_KEPT_S
        self._asked_at = None
        return asked


# The most tokens llama.cpp puts through the graph at once (n_ubatch): a llama_decode of more runs
# several ubatches, each a pass over the weights.
UBATCH_TOKENS = 512


def context_params(
    sequences: int, context_per_sequence: int, batch_tokens: int, threads: int, *, unified: bool, interrupt: _InterruptFlag | None = None
) -> object:
    """llama.cpp context parameters: `sequences` sequences of up to `context_per_sequence` positions
    each, at most `batch_tokens` tokens per llama_decode, stopped midway when `interrupt` is set.
    Without a unified cache, n_ctx is divided evenly between the n_seq_max streams."""
    params = lc.llama_context_default_params()
    params.n_ctx = sequences * context_per_sequence
    params.n_seq_max = sequences
    params.n_batch = batch_tokens
    params.n_ubatch = min(batch_tokens, UBATCH_TOKENS)
    params.n_threads = threads
    params.n_threads_batch = threads
    params.kv_unified = unified
    params.no_perf = True
    if interrupt is not None:
        params.abort_callback = interrupt.callback
        params.abort_callback_data = interrupt.data
    return params


# llama.cpp cuts a batch over a non-unified KV cache into ubatches whose sequence ids run without a
# gap, in the batch's order (llama_batch_allocr::split_equal, sequential), and every ubatch is a
# pass over all the weights: 16 decode rows in reversed slot order took 16 batch-1 steps' time.
# So rows go in slot order, and a gap of at most GAP_FILL_MAX free slots between two rows' slots is
# filled with a throwaway token each (one row's work instead of another pass over the weights),
# taken back out of those slots' cells after the step.
GAP_FILL_MAX = 4
FILLER_TOKEN = 0


def contiguous_plan(slots: Sequence[int], max_gap: int = GAP_FILL_MAX) -> tuple[list[int], list[int]]:
    """The items' order for llama_decode (by slot), and the slots between them to fill so that
    fewer runs of consecutive slots, hence fewer ubatches, remain."""
    order = sorted(range(len(slots)), key=slots.__getitem__)
    ordered = [slots[i] for i in order]
    fillers = [slot for low, high in zip(ordered, ordered[1:]) if 1 < high - low <= max_gap + 1 for slot in range(low + 1, high)]
    return order, fillers


def ubatch_rows(seq_ids: np.ndarray, ubatch_tokens: int) -> np.ndarray:
    """For each token of one llama_decode, how many of its sequence's tokens share its ubatch.

    Over a non-unified KV cache llama.cpp cuts a batch with llama_batch_allocr::split_equal
    (sequential): a ubatch takes the run of consecutive sequence ids that begins with the first
    token not yet taken (a sequence with none left ends the run) and the same number of tokens from
    each: the fewest any of them has left, at most ubatch_tokens // the run's length, at least one.
    Attention picks its kernel by that number (LlamaCppModel.tiled_attention_rows). `seq_ids`:
    each sequence's tokens together, sequences by ascending id (forward's layout)."""
    n = len(seq_ids)
    rows = np.empty(n, dtype=np.int64)
    bounds = [0, *(np.flatnonzero(seq_ids[1:] != seq_ids[:-1]) + 1).tolist(), n] if n else [0]
    ids = [int(seq_ids[b]) for b in bounds[:-1]]
    taken, ends = bounds[:-1], bounds[1:]  # each sequence's next token, and its end
    first = 0
    while True:
        while first < len(ids) and taken[first] == ends[first]:
            first += 1
        if first == len(ids):
            return rows
        run = [first]
        while run[-1] + 1 < len(ids) and ids[run[-1] + 1] == ids[run[-1]] + 1 and taken[run[-1] + 1] < ends[run[-1] + 1]:
            run.append(run[-1] + 1)
        share = min(min(ends[k] - taken[k] for k in run), max(1, ubatch_tokens // len(run)))
        for k in run:
            rows[taken[k] : taken[k] + share] = share
            taken[k] += share


def long_item_pieces(tokens: int, ubatch_tokens: int, min_rows: int) -> list[int]:
    """The sizes, in order, in which forward decodes an item of more than `ubatch_tokens` new tokens,
    one llama_decode each. llama.cpp would cut it into ubatches of ubatch_tokens and a last one of
    what is left, which may hold fewer than `min_rows` (530: 512 + 18, the last 18 computed row by
    row, where a prefill reusing 466 of them computes its 64 tiled); these pieces are as many, none
    longer than a ubatch and none shorter than min_rows (530: 466 + 64) while the ubatch allows it."""
    sizes = []
    while tokens > ubatch_tokens:
        size = min(ubatch_tokens, tokens - min_rows) if tokens - min_rows >= min_rows else ubatch_tokens
        sizes.append(size)
        tokens -= size
    return [*sizes, tokens]


class _Run(NamedTuple):
    """New tokens of one sequence in a llama_decode: a forward item's, a piece of one, or a filler's."""

    item: BatchItem
    owner: int  # the forward item it belongs to (its index); -1: a filler
    offset: int  # where its tokens begin among the item's new tokens
    last: bool  # it ends the item: the logits of its last token are answered


class _BatchBuffers:
    """A llama_batch and the arrays it points at, made once: a step writes its tokens into them
    instead of building a batch (five ctypes casts and a pointer per token) every llama_decode.
    A batch-1 step's Python around llama_decode runs on caches the decode has just flushed, where
    every numpy or ctypes call costs tens of microseconds; llama.cpp reads the arrays only during
    the call."""

    def __init__(self, capacity: int) -> None:
        self.tokens = np.zeros(capacity, dtype=np.int32)
        self.positions = np.zeros(capacity, dtype=np.int32)
        self.seq_ids = np.zeros(capacity, dtype=np.int32)
        self.want_logits = np.zeros(capacity, dtype=np.int8)
        self._n_seq_id = np.ones(capacity, dtype=np.int32)  # one sequence per token, always
        # seq_id is an array of per-token pointers, each to that token's (one) sequence id.
        self._seq_id_ptrs = (self.seq_ids.ctypes.data + 4 * np.arange(capacity, dtype=np.uint64)).astype(np.uint64)
        self.batch = lc.llama_batch(
            n_tokens=0,
            token=self.tokens.ctypes.data_as(ctypes.POINTER(lc.llama_token)),
            embd=None,
            pos=self.positions.ctypes.data_as(ctypes.POINTER(lc.llama_pos)),
            n_seq_id=self._n_seq_id.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)),
            seq_id=self._seq_id_ptrs.ctypes.data_as(ctypes.POINTER(ctypes.POINTER(lc.llama_seq_id))),
            logits=self.want_logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8)),
        )

    def fill(self, tokens: np.ndarray, positions: np.ndarray, seq_ids: np.ndarray, want_logits: np.ndarray) -> object:
        n = len(tokens)
        if n > len(self.tokens):
            raise ValueError(f"a llama_decode of {n} tokens exceeds the batch of {len(self.tokens)}")
        self.tokens[:n] = tokens
        self.positions[:n] = positions
        self.seq_ids[:n] = seq_ids
        self.want_logits[:n] = want_logits
        self.batch.n_tokens = n
        return self.batch


class GpuOffloadUnavailable(RuntimeError):
    """Layers were asked to go to a GPU, but this llama.cpp was built for the CPU only."""


def require_gpu_offload(gpu_layers: int) -> None:
    """Fails when `gpu_layers` asks for a GPU that this build of llama.cpp cannot use: llama.cpp
    itself would silently keep every layer on the CPU."""
    if gpu_layers != 0 and not lc.llama_supports_gpu_offload():
        raise GpuOffloadUnavailable(
            f"gpu_layers={gpu_layers} asks llama.cpp to offload layers to a GPU, but the installed"
            " llama-cpp-python was built without GPU support (llama_supports_gpu_offload() is false);"
            ' rebuild it with CMAKE_ARGS="-DGGML_CUDA=on" (a CUDA toolkit is needed to compile it)'
        )


class LlamaCppModel:
    # llama.cpp's CPU flash attention (on: flash_attn_type is left at auto) runs a sequence's query
    # rows through a tiled kernel from GGML_FA_TILE_Q (64) rows of it in a ubatch on, row by row below
    # (ggml-cpu ops.cpp); forward records which rows ran tiled (last_tiled, from ubatch_rows), and the
    # prefix cache reuses only cells computed as a cold prefill would compute them.
    # Bit-exact reuse is a CPU guarantee: with layers on a GPU (gpu_layers != 0), CUDA's ggml picks
    # its matrix kernels by the whole ubatch's token count, so no rule on a sequence's own rows makes
    # reused cells exact, and the rule would only prefill tokens again: None there (see __init__).
    tiled_attention_rows: int | None = 64
    reuse_bit_exact = True  # on the CPU (exact_reuse); not on a GPU (see __init__)

    def __init__(
        self,
        gguf_path: str,
        max_slots: int,
        max_context: int,
        *,
        threads: int,
        batch_tokens: int = 2048,
        gpu_layers: int = 0,
        main_gpu: int | None = None,
        adaptive_threads: bool = False,
    ) -> None:
        """gpu_layers: layers offloaded to the GPU (-1: all). main_gpu: the one GPU (its index among
        the visible devices) that holds them; None lets llama.cpp split the layers over every GPU.
        adaptive_threads: on the CPU, step with fewer of the threads while another process takes
        cores (thread_governor.py)."""
        require_gpu_offload(gpu_layers)
        if gpu_layers != 0:
            self.tiled_attention_rows = None
            self.reuse_bit_exact = False
        init_backend_once()
        model_params = lc.llama_model_default_params()
        model_params.n_gpu_layers = gpu_layers
        if main_gpu is not None:
            # Without split mode NONE, llama.cpp spreads layers over all visible GPUs and main_gpu
            # only holds the scratch buffers; a Triton instance owns one device.
            model_params.split_mode = lc.LLAMA_SPLIT_MODE_NONE
            model_params.main_gpu = main_gpu
        if gpu_layers == 0:
            # The CPU alone (an empty, NULL-terminated device list). Left to choose, a GPU build of
            # llama.cpp still hands the GPU batched matrix products (op offload, from 32 tokens a
            # step) while the weights stay on the CPU.
            no_devices = (ctypes.c_void_p * 1)()
            model_params.devices = ctypes.addressof(no_devices)
        self._model = lc.llama_model_load_from_file(gguf_path.encode(), model_params)
        if not self._model:
            raise RuntimeError(f"llama.cpp could not load {gguf_path}")
        self._interrupt = _InterruptFlag()
        params = context_params(max_slots, max_context, batch_tokens, threads, unified=False, interrupt=self._interrupt)
        self._ctx = lc.llama_init_from_model(self._model, params)
        if not self._ctx:
            lc.llama_model_free(self._model)
            raise RuntimeError(f"llama.cpp could not make a context of {max_slots} x {max_context} positions")
        self._memory = lc.llama_get_memory(self._ctx)
        self._vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self._model))
        self.max_context = max_context
        self._slot_count = max_slots
        self.batch_tokens = batch_tokens
        self._ubatch_tokens = min(batch_tokens, UBATCH_TOKENS)  # context_params' n_ubatch
        # For each item of the last forward pass, whether each of its new tokens ran attention's tiled
        # kernel (tiled_attention_rows rows or more of its sequence in its ubatch).
        self.last_tiled: list[list[bool]] = []
        self._batch = _BatchBuffers(batch_tokens)
        self._governor = ThreadGovernor(threads) if adaptive_threads and gpu_layers == 0 and threads > 1 else None
        self._threads = threads
        # Slots that a copy queued since the last llama_decode reads or writes (see copy).
        self._copying: set[int] = set()
        # Named in the thread log: triton-local steps a second model (its Q4_0 variant) in the same
        # process, whose governor judges the box on its own (its health probes on a busy box).
        self._model_file = os.path.basename(gguf_path)

    @property
    def threads_in_use(self) -> int:
        """The threads the next step computes with (fewer than configured while the box is busy)."""
        return self._threads

    def interrupt(self, keep: bool = False) -> bool:
        """Stops the interruptible forward pass in progress (llama.cpp's CPU backend checks between
        graph nodes; a GPU graph runs to its end); whether one was in progress. With `keep`, when
        none was, the next forward pass to start within ASK_KEPT_S does not start if it is
        interruptible (StepInterrupted)."""
        return self._interrupt.set(keep)

    def forward(self, items: list[BatchItem], interruptible: bool = False) -> np.ndarray:
        """[len(items), vocab] logits of each item's last new token. `interruptible`: `interrupt()`
        may stop it midway (StepInterrupted), leaving every item's cells as they were. Afterwards
        `last_tiled` says, for each item's new tokens, which ran attention's tiled kernel."""
        if any(not it.token_ids for it in items):
            raise ValueError("every batch item needs at least one token")
        for it in items:
            if it.start_pos + len(it.token_ids) > self.max_context:
                raise ValueError(f"sequence needs {it.start_pos + len(it.token_ids)} positions; the context holds {self.max_context}")
        tile = self.tiled_attention_rows
        # An item longer than a ubatch goes alone, in pieces of at least a tile (long_item_pieces):
        # as many ubatches as llama.cpp would make of it, beside the others or not. Only on the CPU,
        # where a tile means something.
        alone = [i for i, it in enumerate(items) if tile is not None and len(it.token_ids) > self._ubatch_tokens]
        together = [i for i in range(len(items)) if i not in alone]
        out = np.empty((len(items), self._vocab), dtype=np.float32)
        self.last_tiled = [[False] * len(it.token_ids) for it in items]
        fillers: list[BatchItem] = []
        if not interruptible:
            self._interrupt.forget()
        elif self._interrupt.arm():  # an ask came first: left unarmed, nothing decoded
            raise StepInterrupted(f"interrupted: a step of {sum(len(it.token_ids) for it in items)} tokens stopped before it started")
        try:
            for i in alone:
                item, done = items[i], 0
                for size in long_item_pieces(len(item.token_ids), self._ubatch_tokens, tile or 1):
                    piece = BatchItem(item.slot, item.token_ids[done : done + size], item.start_pos + done)
                    self._decode_runs([_Run(piece, i, done, done + size == len(item.token_ids))], out)
                    done += size
            if together:
                # After the pieces: a filler in an alone item's slot goes after its new cells.
                _, filler_slots = contiguous_plan([items[i].slot for i in together])
                fillers = self._fillers(filler_slots)
                runs = [_Run(items[i], i, 0, True) for i in together] + [_Run(f, -1, 0, False) for f in fillers]
                self._decode_runs(sorted(runs, key=lambda run: run.item.slot), out)
        except StepInterrupted:
            # llama.cpp takes back the cells of the ubatch it stopped in, not those of the ubatches before.
            for item in items:
                self.truncate(item.slot, item.start_pos)
            raise
        finally:
            if interruptible:
                self._interrupt.disarm()
            for filler in fillers:
                self.truncate(filler.slot, filler.start_pos)
        return out

    def _decode_runs(self, runs: list[_Run], out: np.ndarray) -> None:
        """Decodes the runs, in their order (by slot), in llama_decode calls of at most batch_tokens;
        writes the logits of each run that ends its item into `out` and records which of the runs'
        tokens ran the tiled kernel (last_tiled)."""
        tokens = np.fromiter((t for run in runs for t in run.item.token_ids), dtype=np.int32)
        positions = np.concatenate([np.arange(run.item.start_pos, run.item.start_pos + len(run.item.token_ids), dtype=np.int32) for run in runs])
        seq_ids = np.concatenate([np.full(len(run.item.token_ids), run.item.slot, dtype=np.int32) for run in runs])
        ends = np.cumsum([len(run.item.token_ids) for run in runs]) - 1  # each run's last token
        wanted_ends = [int(end) for end, run in zip(ends, runs) if run.last]  # ascending
        want_logits = np.zeros(len(tokens), dtype=np.int8)
        want_logits[wanted_ends] = 1
        answer_rows = [run.owner for run in runs if run.last]  # the item each wanted logit row belongs to
        tile = self.tiled_attention_rows
        # Its sequence's rows in each token's ubatch, when some run could have a tile of them.
        rows = np.ones(len(tokens), dtype=np.int64) if tile is not None and any(len(run.item.token_ids) >= tile for run in runs) else None
        row = 0
        for start in range(0, len(tokens), self.batch_tokens):
            end = min(len(tokens), start + self.batch_tokens)
            self._decode(tokens[start:end], positions[start:end], seq_ids[start:end], want_logits[start:end])
            if rows is not None:
                rows[start:end] = ubatch_rows(seq_ids[start:end], self._ubatch_tokens)
            # The call's output rows, in batch order (llama_get_logits reorders them so), in one copy.
            n = bisect.bisect_left(wanted_ends, end) - row
            if n:
                out[answer_rows[row : row + n]] = self._logits(n)
                row += n
        if rows is not None and tile is not None:  # else no sequence had a tile of rows in a ubatch: none ran tiled
            tiled = rows >= tile
            first = 0
            for run in runs:
                n = len(run.item.token_ids)
                if run.owner >= 0:
                    self.last_tiled[run.owner][run.offset : run.offset + n] = tiled[first : first + n].tolist()
                first += n

    def _logits(self, rows: int) -> np.ndarray:
        """The last llama_decode's `rows` logit rows, a view of llama.cpp's own buffer (valid until
        the next decode: copied out at once): a ctypes array over its address, cheaper than
        np.ctypeslib.as_array."""
        address = ctypes.cast(lc.llama_get_logits(self._ctx), ctypes.c_void_p).value
        return np.frombuffer((ctypes.c_float * (rows * self._vocab)).from_address(address), dtype=np.float32).reshape(rows, self._vocab)

    def _fillers(self, slots: list[int]) -> list[BatchItem]:
        """A throwaway token for each slot, after the cells it holds (a cached prefix or a sequence
        not in this step keeps them: the token is removed after the step); none for a full slot."""
        fillers = []
        for slot in slots:
            position = lc.llama_memory_seq_pos_max(self._memory, slot) + 1
            if position < self.max_context:
                fillers.append(BatchItem(slot, [FILLER_TOKEN], position))
        return fillers

    def release(self, slot: int) -> None:
        lc.llama_memory_seq_rm(self._memory, slot, -1, -1)

    def copy(self, source: int, target: int) -> None:
        # Slots are streams of their own: llama.cpp copies the whole stream's buffers, at the
        # start of the next llama_decode (before that step's tokens are written anywhere), while
        # the target's cell positions change at once.
        lc.llama_memory_seq_cp(self._memory, source, target, -1, -1)
        self._copying.update((source, target))

    def truncate(self, slot: int, keep: int) -> None:
        lc.llama_memory_seq_rm(self._memory, slot, keep, -1)

    def save_state(self, slot: int) -> bytes:
        """The slot's KV cells, serialized (host_prefix_store.py)."""
        self._apply_copies(slot)
        size = lc.llama_state_seq_get_size(self._ctx, slot)
        buffer = (ctypes.c_uint8 * size)()
        written = lc.llama_state_seq_get_data(self._ctx, buffer, size, slot)
        if written != size:
            raise RuntimeError(f"llama_state_seq_get_data wrote {written} of {size} bytes for slot {slot}")
        return bytes(buffer)

    def restore_state(self, slot: int, state: bytes) -> None:
        """Writes cells that save_state serialized into an empty slot."""
        self._apply_copies(slot)
        source = (ctypes.c_uint8 * len(state)).from_buffer_copy(state)
        if lc.llama_state_seq_set_data(self._ctx, source, len(state), slot) != len(state):
            raise RuntimeError(f"llama_state_seq_set_data could not restore {len(state)} bytes into slot {slot}")

    def _apply_copies(self, slot: int) -> None:
        """Runs the copies still queued when `slot` is one's source or target. State is read and
        written at once, the queued copy only at the next llama_decode: it would then carry a
        source's restored cells into its target, or overwrite a target's restored cells, and a
        target saved before it holds what it held before. llama.cpp applies copies in no other
        call, so a throwaway token is decoded (and taken out again)."""
        if slot not in self._copying:
            return
        # Its own slot usually has room; any slot's will do (llama_decode applies every copy first).
        item = next((f for s in (slot, *range(self._slot_count)) for f in self._fillers([s])), None)
        if item is None:
            raise RuntimeError(f"no slot has a free position to apply the copies queued for slot {slot}")
        one = np.ones(1, dtype=np.int32)
        self._decode(one * FILLER_TOKEN, one * item.start_pos, one * item.slot, np.zeros(1, dtype=np.int8))
        self.truncate(item.slot, item.start_pos)

    def close(self) -> None:
        if self._ctx:
            lc.llama_free(self._ctx)
            self._ctx = None
        if self._model:
            lc.llama_model_free(self._model)
            self._model = None

    def _use_threads(self, governor: ThreadGovernor, threads: int) -> None:
        if threads != self._threads:
            lc.llama_set_n_threads(self._ctx, threads, threads)
            log.info(
                "engine_threads_changed: %s %d -> %d of %d (%s)", self._model_file, self._threads, threads, governor.configured, governor.last_reason
            )
            self._threads = threads

    def _decode(self, tokens: np.ndarray, positions: np.ndarray, seq_ids: np.ndarray, want_logits: np.ndarray) -> None:
        """One llama_decode of at most batch_tokens tokens, through the batch buffers."""
        batch = self._batch.fill(tokens, positions, seq_ids, want_logits)
        n = len(tokens)
        governor = self._governor
        if governor is None:
            status = lc.llama_decode(self._ctx, batch)
        else:
            self._use_threads(governor, governor.before_decode())
            started, cpu_started = time.perf_counter(), time.thread_time()
            status = lc.llama_decode(self._ctx, batch)
            self._use_threads(governor, governor.after_decode(time.perf_counter() - started, time.thread_time() - cpu_started))
        if status >= 0:  # llama.cpp applied the queued copies before anything that returns these
            self._copying.clear()
        if status == 2:
            raise StepInterrupted(f"interrupted: a step of {n} tokens stopped midway")
        if status != 0:
            # 1: no KV room for the batch; 2: aborted; < 0: error. Nothing of the batch was kept.
            raise RuntimeError(f"llama_decode failed with status {status} for {n} tokens")
