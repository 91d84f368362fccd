"""The llama.cpp backend: the ONLY module that imports llama_cpp.

Everything else talks to `Model` (weights + vocabulary) and `Context` (a KV cache with a
reusable batch). Batches are filled through numpy views over the llama_batch arrays and logits
are read as numpy views over llama.cpp's output buffer, so a step's Python overhead stays small.

Tree verification needs no special API: a token can carry several sequence ids. With
`kv_unified=True` a KV cell shared by several sequences is stored once, so a tree node carries the
ids of every leaf below it and attends exactly to its ancestors.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llama_cpp as ll
import numpy as np

from edgespec import chat, markers
from edgespec.config import ModelConfig
from edgespec.errors import BadRequest, ForwardAborted, IncompatibleDraft, ModelError
from edgespec.heap import keep_freed_memory
from edgespec.pairing import Pairing
from edgespec.pairing import TextPairing as TextPairing
from edgespec.pairing import check_compatible as check_compatible  # the engine's entry points
from edgespec.pairing import pair as pair
from edgespec.plan import QUERY_LIKELIHOOD_ROWS

_init_lock = threading.Lock()
_initialised = False
_log_cb = None  # keep the ctypes callback alive


def _init() -> None:
    global _initialised, _log_cb
    with _init_lock:
        if _initialised:
            return
        # ggml's tiled K-quant mat-mul takes products of 8+ tokens and rounds differently from the
        # per-element dot products of narrower ones: off, every width takes the dot products (a
        # K-quant prompt costs ~15 % more CPU time; decoding the same). An operator who trades
        # exactness for that sets GGML_CPU_TILED_MM=1 (Engine.exactness then says so).
        os.environ.setdefault("GGML_CPU_TILED_MM", "0")
        ll.llama_backend_init()
        keep_freed_memory()  # the step's numpy temporaries reuse freed heap (edgespec/heap.py)
        verbose = os.environ.get("EDGESPEC_LLAMA_LOG", "") not in ("", "0")

        @ll.llama_log_callback
        def _cb(level, text, user_data):
            if verbose:
                os.write(2, text)

        _log_cb = _cb
        ll.llama_log_set(_log_cb, ctypes.c_void_p(0))
        _initialised = True


_FILE_TYPES = {0: "f32", 1: "f16", 2: "q4_0", 3: "q4_1", 7: "q8_0", 8: "q5_0", 9: "q5_1", 10: "q2_k", 15: "q4_k_m",
               17: "q5_k_m", 18: "q6_k", 25: "iq4_nl", 32: "bf16"}
_KV_TYPES = {"f32": ll.GGML_TYPE_F32, "f16": ll.GGML_TYPE_F16, "q8_0": ll.GGML_TYPE_Q8_0, "q4_0": ll.GGML_TYPE_Q4_0}
_FTYPES = {
    "f32": ll.LLAMA_FTYPE_ALL_F32,
    "f16": ll.LLAMA_FTYPE_MOSTLY_F16,
    "q8_0": ll.LLAMA_FTYPE_MOSTLY_Q8_0,
    "q4_0": ll.LLAMA_FTYPE_MOSTLY_Q4_0,
    "q4_1": ll.LLAMA_FTYPE_MOSTLY_Q4_1,
    "q5_0": ll.LLAMA_FTYPE_MOSTLY_Q5_0,
    "q5_1": ll.LLAMA_FTYPE_MOSTLY_Q5_1,
    "iq4_nl": ll.LLAMA_FTYPE_MOSTLY_IQ4_NL,
    "q2_k": ll.LLAMA_FTYPE_MOSTLY_Q2_K,
    "q4_k_m": ll.LLAMA_FTYPE_MOSTLY_Q4_K_M,
    "q5_k_m": ll.LLAMA_FTYPE_MOSTLY_Q5_K_M,
    "q6_k": ll.LLAMA_FTYPE_MOSTLY_Q6_K,
}
FTYPES = tuple(_FTYPES)


def gpu_offload_supported() -> bool:
    _init()
    return bool(ll.llama_supports_gpu_offload())


def quantize(src: Path, dst: Path, ftype: str, threads: int = 0) -> None:
    """Write `dst` as `src` converted to `ftype` with llama.cpp's own quantizer."""
    _init()
    if ftype not in _FTYPES:
        raise ModelError(f"unknown ftype {ftype!r}; one of {', '.join(_FTYPES)}")
    params = ll.llama_model_quantize_default_params()
    params.ftype = _FTYPES[ftype]
    params.nthread = threads or (os.cpu_count() or 1)
    params.allow_requantize = True
    rc = ll.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        raise ModelError(f"llama_model_quantize({src} -> {ftype}) failed with code {rc}")


# weight types whose CPU mat-muls give every token the bits of a one-token forward at any batch
# width, with the patch (tools/patches/), the target's weights unrepacked (Model `repack`) and
# ggml's tiled K-quant kernel taken at every width (`_init`); tests/test_backend_exact.py checks
# each one. F32 covers the norms and biases every file carries.
EXACT_CPU_TYPES = frozenset({"F32", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q3_K", "Q4_K", "Q5_K", "Q6_K"})
K_QUANTS = frozenset({"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"})
# what ggml's CPU backend repacks on x86 (AVX2): stock ggml's 4-token gemm and one-token gemv
# round Q4_K apart
REPACKED_TYPES = frozenset({"Q4_0", "Q4_K", "Q2_K", "IQ4_NL", "MXFP4"})
# the repacked layouts whose kernels give a column the same bits at every batch width in a build
# with tools/patches/ggml-repack-invariant.patch (tests/test_model_families.py checks each)
INVARIANT_REPACKED_TYPES = frozenset({"Q4_0", "Q4_K"})


def repack_invariant() -> bool:
    """Whether the loaded ggml's x86 repacked kernels are batch-invariant: the patch's
    `edgespec_repack_invariant` symbol (compiled only where the kernels it fixes are, AVX2 and
    AVX-512 builds)."""
    _init()
    try:
        return bool(ll.llama_cpp._lib.edgespec_repack_invariant)
    except AttributeError:
        return False


def exact_repack(path: str | Path) -> bool:
    """Whether a CPU target loads with ggml's repacked layouts and stays bit-exact: the library's
    repacked kernels are invariant and the file holds no type repacked into a layout they do not
    cover (Q2_K, IQ4_NL, MXFP4 then load as the file has them, as without the patch)."""
    return repack_invariant() and not weight_types(Path(path)) & (REPACKED_TYPES - INVARIANT_REPACKED_TYPES)


def target_repack(path: str | Path, n_gpu_layers: int, fast_kernels: bool = False) -> bool:
    """Model `repack` for a target: on a GPU always (ggml repacks only CPU-resident weights); on
    a CPU where the repacked kernels are batch-invariant for its types (`exact_repack`), or where
    [target] fast_kernels gives up exactness for llama.cpp's own kernels."""
    return n_gpu_layers != 0 or fast_kernels or exact_repack(path)


def exact_cpu_types() -> frozenset[str]:
    """EXACT_CPU_TYPES as this process runs them: without the K-quants when ggml's tiled
    K-quant kernel was left on (GGML_CPU_TILED_MM=1)."""
    if os.environ.get("GGML_CPU_TILED_MM", "0") != "0":
        return EXACT_CPU_TYPES - K_QUANTS
    return EXACT_CPU_TYPES


# GGUF metadata value types -> their size in bytes (8: string, 9: array, read apart)
_GGUF_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def weight_types(path: Path) -> frozenset[str]:
    """The tensor types of a GGUF file ("F32", "Q4_K", ...), from its tensor table."""
    return frozenset(t for _, t in tensor_table(path))


def tensor_table(path: Path) -> list[tuple[str, str]]:
    """(name, type) of each tensor of a GGUF file, read from its tensor table. The metadata before
    it is skipped by lengths, not decoded: gguf's reader builds every token string of a 262k
    vocabulary in Python (11 s for Gemma 3's header), which the daemon's start need not pay."""
    import mmap

    from gguf import GGMLQuantizationType

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        def u(at: int, n: int) -> int:
            return int.from_bytes(m[at:at + n], "little")

        if m[:4] != b"GGUF":
            raise ModelError(f"{path}: not a GGUF file")
        n_tensors, n_kv, at = u(8, 8), u(16, 8), 24

        def skip(kind: int, at: int) -> int:
            if kind == 8:  # string: u64 length, bytes
                return at + 8 + u(at, 8)
            if kind == 9:  # array: u32 element type, u64 count, elements
                elem, count, at = u(at, 4), u(at + 4, 8), at + 12
                if elem in _GGUF_SIZES:
                    return at + count * _GGUF_SIZES[elem]
                for _ in range(count):
                    at = skip(elem, at)
                return at
            return at + _GGUF_SIZES[kind]

        for _ in range(n_kv):
            at = skip(8, at)  # the key
            at = skip(u(at, 4), at + 4)
        table = []
        for _ in range(n_tensors):
            name = bytes(m[at + 8:at + 8 + u(at, 8)]).decode("utf-8", "replace")
            at = skip(8, at)
            n_dims = u(at, 4)
            at += 4 + 8 * n_dims
            table.append((name, GGMLQuantizationType(u(at, 4)).name))
            at += 4 + 8  # type, data offset
    return table


class Model:
    """Weights and vocabulary of one GGUF model (shared by all its contexts)."""

    def __init__(self, path: str | Path, n_gpu_layers: int = 0, repack: bool = True):
        """`repack`: let ggml's CPU backend convert Q4_0, Q4_K, IQ4_NL (and on ARM more) weights
        to its interleaved layouts. In stock ggml their batched kernel (4 tokens at a time) and
        their one-token kernel round Q4_K differently, so a token's logits would depend on its
        place in the batch: a target whose verification must reproduce plain decoding bit for bit
        loads repacked only where `exact_repack` says the library's kernels are invariant for
        its types, and otherwise without (its types then take ggml's per-element dot products;
        tests/test_model_families.py checks each type at every batch width, both ways)."""
        _init()
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelError(f"model file not found: {self.path}")
        mp = ll.llama_model_default_params()
        mp.n_gpu_layers = 10_000 if n_gpu_layers < 0 else n_gpu_layers
        self.repacked = repack
        if not repack:
            mp.use_extra_bufts = False
        self._model = ll.llama_model_load_from_file(str(self.path).encode(), mp)
        if not self._model:
            raise ModelError(f"llama.cpp could not load {self.path} (not a valid GGUF?)")
        self._vocab = ll.llama_model_get_vocab(self._model)
        self.n_vocab = int(ll.llama_vocab_n_tokens(self._vocab))
        self.bos = int(ll.llama_vocab_bos(self._vocab))
        self.eos = int(ll.llama_vocab_eos(self._vocab))
        self.sep = int(ll.llama_vocab_sep(self._vocab))  # -1: none (a cross-encoder's pair separator)
        self.add_bos = bool(ll.llama_vocab_get_add_bos(self._vocab))
        self.add_eos = bool(ll.llama_vocab_get_add_eos(self._vocab))
        self.vocab_type = int(ll.llama_vocab_type(self._vocab))
        self.n_params = int(ll.llama_model_n_params(self._model))
        self.size_bytes = int(ll.llama_model_size(self._model))
        self.n_layer = int(ll.llama_model_n_layer(self._model))
        self.n_embd = int(ll.llama_model_n_embd(self._model))
        self.n_ctx_train = int(ll.llama_model_n_ctx_train(self._model))
        # the sliding window of its interleaved sliding-window attention layers (0: none)
        self.n_swa = int(ll.llama_model_n_swa(self._model))
        buf = ctypes.create_string_buffer(256)
        ll.llama_model_desc(self._model, buf, 256)
        self.desc = buf.value.decode(errors="replace")
        # the types its tensors are stored in ("F32", "Q4_K", ...), from the GGUF's tensor table
        self.weight_types = weight_types(self.path)
        # the weights' type (GGUF general.file_type): "f32", "f16", "q8_0", ... or "other"
        ft = model_meta(self, "general.file_type")
        self.ftype = _FILE_TYPES.get(int(ft), "other") if ft and ft.isdigit() else "other"
        self._eog = np.array([bool(ll.llama_vocab_is_eog(self._vocab, t)) for t in range(self.n_vocab)])
        self.eog_tokens: tuple[int, ...] = tuple(int(t) for t in np.flatnonzero(self._eog))  # ignore_eos bans them
        # texts tokenize(parse_special=True) turns into one control token (`<|im_start|>`, `</s>`):
        # what edgespec.chat lets only the chat template produce
        special = ll.LLAMA_TOKEN_ATTR_CONTROL | ll.LLAMA_TOKEN_ATTR_UNKNOWN
        self.special_tokens: dict[str, int] = {}
        # control tokens that are a reasoning or tool-call marker (`<think>` one token): rendered as
        # their text, by id, so that the answer's parsers and the grammar see them (edgespec.markers)
        self.kept_markers: dict[int, bytes] = {}
        for t in range(self.n_vocab):
            if ll.llama_vocab_get_attr(self._vocab, t) & special:
                text = self.token_text(t).decode("utf-8", errors="replace")
                if text:
                    self.special_tokens.setdefault(text, t)
                    self.kept_markers.update(markers.preserved({text: t}))
        self._piece_cache: dict[int, bytes] = dict(self.kept_markers)
        tmpl = ll.llama_model_chat_template(self._model, None)
        self.chat_template: bytes | None = tmpl if tmpl else None

    # -- vocabulary ---------------------------------------------------------------------------
    def is_eog(self, token: int) -> bool:
        return bool(self._eog[token])

    def token_text(self, token: int) -> bytes:
        return ll.llama_vocab_get_text(self._vocab, token) or b""

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        data = text.encode("utf-8")
        n_max = len(data) + 8
        arr = (ll.llama_token * n_max)()
        n = ll.llama_tokenize(self._vocab, data, len(data), arr, n_max, add_special, parse_special)
        if n < 0:
            n_max = -n
            arr = (ll.llama_token * n_max)()
            n = ll.llama_tokenize(self._vocab, data, len(data), arr, n_max, add_special, parse_special)
        return list(arr[:n])

    def piece(self, token: int) -> bytes:
        """The bytes a token renders as (control tokens rendered empty, but the markers in
        `kept_markers`: their text)."""
        b = self._piece_cache.get(token)
        if b is None:
            buf = ctypes.create_string_buffer(64)
            n = ll.llama_token_to_piece(self._vocab, token, buf, 64, 0, False)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = ll.llama_token_to_piece(self._vocab, token, buf, -n, 0, False)
            b = buf.raw[:n]
            self._piece_cache[token] = b
        return b

    def detokenize(self, tokens: Sequence[int]) -> str:
        return b"".join(self.piece(t) for t in tokens).decode("utf-8", errors="replace")

    def chat_prompt(self, messages: Sequence[tuple[str, str]]) -> str:
        """The GGUF's Jinja chat template rendered for `messages` (jinja2's sandbox, the variables
        llama.cpp's --jinja gives it: edgespec.chat.ChatTemplate), the assistant generation prompt
        appended. Every chat renders the model's own template, so the prompt is the one the model
        was trained on (SmolLM2's adds its default system message, which llama.cpp's built-in
        ChatML matcher leaves out). Text only: edgespec.chat.encode_chat turns messages into
        tokens (contents never parsed for special tokens). Thread-safe (reads the vocabulary)."""
        if not messages:
            raise ModelError("chat needs at least one message")
        template = chat.template_of(self)
        if template is None:  # llama.cpp would fall back to ChatML: text the model never saw
            raise BadRequest("messages", f"{self.path.name} has no chat template (a base model?): send a raw "
                             "prompt (/v1/completions, `generate --raw`), or set [target] chat_template to a "
                             "Jinja template file")
        return template.render([{"role": role, "content": content} for role, content in messages])

    def close(self) -> None:
        if getattr(self, "_model", None):
            ll.llama_model_free(self._model)
            self._model = None

    def __del__(self) -> None:  # pragma: no cover
        try:
            self.close()
        except Exception:
            pass


def _abort_fn():
    """The patched libllama's `edgespec_abort_flag` (tools/patches/): an abort callback that reads
    an int32 flag, polled by the CPU backend between graph nodes with no Python call (no GIL on
    the compute thread). None for a libllama without it."""
    try:
        addr = ctypes.cast(ll.llama_cpp._lib.edgespec_abort_flag, ctypes.c_void_p).value
    except AttributeError:
        return None
    return ll.ggml_abort_callback(addr)


class _Decoding:
    """What a target, draft and head context share: one decode loop (batches split into n_batch
    pieces, each a llama.cpp forward that writes its cells before the next reads them), the KV
    cache operations and the abort flag. Subclasses fill their batch (`_fill`) and run it
    (`_forward`)."""

    _ctx = None
    _mem = None
    n_batch = 0
    decode_seconds = 0.0
    _abort_flag = None
    _abort_cb = None
    scratch_seq = -1  # the sequence id padding tokens go in (Context(scratch=True)); -1: none
    # tokens -> the width a forward of them runs at (a fixed set: controller/widths.py); None: unpadded
    pad_width: Callable[[int], int] | None = None
    forward_widths: Counter[int]  # llama_decode calls by the tokens handed to llama.cpp
    padded_tokens = 0  # inert tokens those calls carried

    def _arm_abort(self) -> None:
        """Install the flag-reading abort callback on this context (after llama_init_from_model)."""
        cb = _abort_fn()
        if cb is None:
            return
        self._abort_flag = ctypes.c_int32(0)
        self._abort_cb = cb  # keep the callback object alive with the context
        ll.llama_set_abort_callback(self._ctx, cb, ctypes.cast(ctypes.byref(self._abort_flag), ctypes.c_void_p))

    @property
    def abortable(self) -> bool:
        return self._abort_flag is not None

    def abort(self) -> None:
        """Stop the forward in progress (from any thread) at its next graph node, and every later
        one until `clear_abort()`: the decode raises ForwardAborted."""
        if self._abort_flag is not None:
            self._abort_flag.value = 1

    def clear_abort(self) -> None:
        if self._abort_flag is not None:
            self._abort_flag.value = 0

    def set_threads(self, n: int) -> None:
        """CPU threads of this context's forwards from now on (every element's reduction order is
        the same at any count: the thread governor changes time only)."""
        ll.llama_set_n_threads(self._ctx, n, n)

    def _decode_pieces(self, tokens: Sequence[int], positions: Sequence[int], seq_ids: Sequence[Sequence[int]],
                       logits: Sequence[bool], embd: np.ndarray | None = None) -> None:
        """One forward per n_batch piece (larger batches only for runs whose tokens all belong
        to the same sequences, or whose pieces come in dependency order)."""
        n = len(tokens)
        start = 0
        while start < n:
            m = min(self.n_batch, n - start)
            sl = slice(start, start + m)
            self._fill(tokens[sl], positions[sl], seq_ids[sl], logits[sl], None if embd is None else embd[sl])
            w = self._pad(m)
            self.forward_widths[w] += 1
            self.padded_tokens += w - m
            t0 = time.perf_counter()
            try:
                rc = self._forward(w)
            finally:
                if w > m:  # the padding's cells go at once: nothing else ever sees them
                    self.seq_rm(self.scratch_seq)
            self.decode_seconds += time.perf_counter() - t0
            if rc == 2 and self._abort_flag is not None and self._abort_flag.value:
                raise ForwardAborted(f"forward of {m} tokens aborted")
            if rc != 0:
                raise ModelError(f"llama_decode failed with code {rc} (batch of {m} tokens, KV cache full?)")
            self._decoded(m)
            start += m
        self._last_n = n

    def _fill(self, tokens, positions, seq_ids, logits, embd) -> None:
        raise NotImplementedError

    def _pad(self, m: int) -> int:
        """The width the filled batch of m tokens is handed to llama.cpp at: m, or (a context made
        with a scratch sequence, `pad_width` set) the width `pad_width(m)` names, the batch's
        tail then filled with inert tokens of the scratch sequence (Context._pad)."""
        return m

    def _forward(self, m: int) -> int:
        raise NotImplementedError

    def _decoded(self, m: int) -> None:
        """After each forward of `decode` (m tokens): a hook for what must be read before the next."""

    def _free_batch(self) -> None:
        raise NotImplementedError

    # -- KV cache -----------------------------------------------------------------------------
    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> None:
        ll.llama_memory_seq_rm(self._mem, seq, p0, p1)

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        ll.llama_memory_seq_cp(self._mem, src, dst, p0, p1)

    def pos_max(self, seq: int) -> int:
        return int(ll.llama_memory_seq_pos_max(self._mem, seq))

    def pos_min(self, seq: int) -> int:
        return int(ll.llama_memory_seq_pos_min(self._mem, seq))

    def clear(self) -> None:
        ll.llama_memory_clear(self._mem, True)

    def seq_state(self, seq: int) -> bytes:
        """The cells of sequence `seq` (every layer's KV of every position it holds) as bytes: a
        host-memory copy that `load_seq_state` writes back bit for bit (edgespec/prompt_store.py)."""
        n = ll.llama_state_seq_get_size(self._ctx, seq)
        buf = ctypes.create_string_buffer(n)
        got = ll.llama_state_seq_get_data(self._ctx, ctypes.cast(buf, ctypes.POINTER(ctypes.c_uint8)), n, seq)
        if got == 0:
            raise ModelError(f"could not copy sequence {seq}'s cells ({n} bytes)")
        return ctypes.string_at(buf, got)

    def load_seq_state(self, seq: int, data: bytes) -> None:
        """Write cells copied by `seq_state` into the empty sequence `seq` (their positions as
        they were); ModelError when the cache has no room for them."""
        src = ctypes.cast(ctypes.c_char_p(data), ctypes.POINTER(ctypes.c_uint8))  # no copy: read only
        if ll.llama_state_seq_set_data(self._ctx, src, len(data), seq) == 0:
            raise ModelError(f"could not restore {len(data)} bytes of cells into sequence {seq}")

    def close(self) -> None:
        if getattr(self, "_ctx", None):
            self._free_batch()
            ll.llama_free(self._ctx)
            self._ctx = None

    def __del__(self) -> None:  # pragma: no cover
        try:
            self.close()
        except Exception:
            pass


def _context_params(cfg: ModelConfig, n_seq_max: int, n_ctx: int | None):
    cp = ll.llama_context_default_params()
    cp.n_ctx = n_ctx or cfg.n_ctx  # cells: a context shared by several slots holds all of theirs
    cp.n_batch = cfg.n_batch
    cp.n_ubatch = cfg.n_batch
    cp.n_seq_max = n_seq_max
    cp.n_threads = cfg.n_threads
    cp.n_threads_batch = cfg.n_threads
    cp.kv_unified = True
    # a sliding-window model's window cache as large as the context: its cells stay until a window
    # masks them for every later token, so a rejected branch can be removed like any other cell
    cp.swa_full = True
    cp.flash_attn_type = ll.LLAMA_FLASH_ATTN_TYPE_ENABLED if cfg.flash_attn else ll.LLAMA_FLASH_ATTN_TYPE_DISABLED
    cp.type_k = _KV_TYPES[cfg.kv_type]
    cp.type_v = _KV_TYPES[cfg.kv_type]
    cp.no_perf = True
    return cp


class Context(_Decoding):
    """One llama.cpp context (its own KV cache) over a loaded Model, plus a reusable batch.

    `scratch`: one more sequence id than `n_seq_max` (`scratch_seq`), which no caller uses: with
    `pad_width` set, a forward of m tokens is padded up to `pad_width(m)` tokens with inert ones
    in that sequence, whose cells are removed right after the forward (so that on a GPU the
    forward's shape repeats and its CUDA graph stays warm: controller/widths.py). They have no
    logits and attend only to each other, and no real token attends to them; the patched CPU
    kernels make every real token's logits and cells independent of what shares its forward and
    where its cells lie (tools/patches/README.md), so on a CPU padding changes no bit."""

    def __init__(self, model: Model, cfg: ModelConfig, n_seq_max: int = 1, n_ctx: int | None = None,
                 scratch: bool = True):
        self.model = model
        self.n_seq_max = n_seq_max
        self.forward_widths = Counter()
        if scratch:
            self.scratch_seq = n_seq_max
        cp = _context_params(cfg, n_seq_max + scratch, n_ctx)
        self._ctx = ll.llama_init_from_model(model._model, cp)
        if not self._ctx:
            raise ModelError(f"llama.cpp could not create a context for {model.path} (n_ctx={cfg.n_ctx})")
        self._arm_abort()
        self.n_ctx = int(ll.llama_n_ctx(self._ctx))
        self.n_batch = cfg.n_batch
        self._mem = ll.llama_get_memory(self._ctx)
        self._batch: Any = ll.llama_batch_init(self.n_batch, 0, n_seq_max + scratch)
        b = self._batch
        nb = self.n_batch
        self._tok: np.ndarray = np.ctypeslib.as_array(b.token, shape=(nb,))
        self._pos: np.ndarray = np.ctypeslib.as_array(b.pos, shape=(nb,))
        self._nseq: np.ndarray = np.ctypeslib.as_array(b.n_seq_id, shape=(nb,))
        self._out: np.ndarray = np.ctypeslib.as_array(b.logits, shape=(nb,))
        self._seq: list[np.ndarray] = [np.ctypeslib.as_array(b.seq_id[i], shape=(n_seq_max + scratch,))
                                       for i in range(nb)]
        self.n_vocab: int = model.n_vocab  # the width of the rows it returns (the target's, for a padded draft)
        self._pairing: Pairing | None = None
        self.decode_seconds = 0.0  # wall time inside llama_decode (the rest of a step is overhead)

    def speak_target_vocab(self, pairing: Pairing) -> None:
        """Make this draft context read and write the target's ids (a padded pair, `Pairing`): its
        rows come back [n, target vocab] with -inf beyond the shared range (its own tail is never
        drafted; the target's tail has probability 0 under the draft), and a target token beyond
        the shared range is decoded as the pairing's substitute (the draft's context only steers
        its proposals; the target verifies every token)."""
        if pairing.padded:
            self._pairing = pairing
            self.n_vocab = pairing.n_target

    # -- decoding -----------------------------------------------------------------------------
    def _fill(self, tokens, positions, seq_ids, logits, embd) -> None:
        m = len(tokens)
        self._tok[:m] = tokens
        if self._pairing is not None:
            self._pairing.to_draft_ids(self._tok[:m])
        self._pos[:m] = positions
        for j in range(m):
            s = seq_ids[j]
            self._nseq[j] = len(s)
            self._seq[j][: len(s)] = s
        self._out[:m] = logits
        self._batch.n_tokens = m

    def _pad(self, m: int) -> int:
        if self.pad_width is None or self.scratch_seq < 0:
            return m
        w = min(self.pad_width(m), self.n_batch)
        if w <= m:
            return m
        # inert tokens: the piece's first token id, at positions 0.. of the (empty) scratch sequence
        self._tok[m:w] = self._tok[0]
        self._pos[m:w] = np.arange(w - m)
        self._nseq[m:w] = 1
        for j in range(m, w):
            self._seq[j][0] = self.scratch_seq
        self._out[m:w] = 0
        self._batch.n_tokens = w
        return w

    def _forward(self, m: int) -> int:
        return ll.llama_decode(self._ctx, self._batch)

    def _free_batch(self) -> None:
        ll.llama_batch_free(self._batch)

    def decode(self, tokens: Sequence[int], positions: Sequence[int], seq_ids: Sequence[Sequence[int]],
               logits: Sequence[bool]) -> None:
        """Entry i is tokens[i] at positions[i] in sequences seq_ids[i]; logits are kept for the
        entries marked in `logits` (one forward per n_batch piece)."""
        self._decode_pieces(tokens, positions, seq_ids, logits)

    def decode_rows(self, tokens: Sequence[int], positions: Sequence[int], seq_ids: Sequence[Sequence[int]],
                    logits: Sequence[bool]) -> np.ndarray:
        """Like `decode`, returning a copy of the logits of every entry marked in `logits`, in
        batch order ([n_marked, vocab]), also when the batch is split into n_batch pieces
        (consecutive llama_decode calls, each writing its cells before the next reads them)."""
        n = len(tokens)
        out = []
        start = 0
        while start < n:
            m = min(self.n_batch, n - start)
            sl = slice(start, start + m)
            self.decode(tokens[sl], positions[sl], seq_ids[sl], logits[sl])
            k = int(sum(1 for x in logits[sl] if x))
            if k:
                out.append(self.logits_rows(k).copy())
            start += m
        if not out:
            return np.empty((0, self.n_vocab), dtype=np.float32)
        return out[0] if len(out) == 1 else np.concatenate(out)

    def decode_seq(self, tokens: Sequence[int], start_pos: int, seq_ids: Sequence[int] = (0,),
                   last_logits: bool = True) -> None:
        """Decode a run of tokens on the same sequences; logits for the last one only."""
        n = len(tokens)
        if n == 0:
            return
        self.decode(tokens, range(start_pos, start_pos + n), [seq_ids] * n,
                    [False] * (n - 1) + [last_logits])

    def logits(self, i: int) -> np.ndarray:
        """[vocab] float32 logits of batch entry i of the LAST decode call (i counted within that
        call's last sub-batch; -1 = last). A view: copy it before the next decode."""
        ptr = ll.llama_get_logits_ith(self._ctx, i)
        if not ptr:
            raise ModelError(f"no logits for batch entry {i}")
        if self._pairing is not None:
            return self._pairing.rows_in_target_vocab(np.ctypeslib.as_array(ptr, shape=(1, self.model.n_vocab)))[0]
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))

    def logits_rows(self, n_rows: int) -> np.ndarray:
        """[n_rows, vocab] logits of the last decode's outputs, in batch order (a view; a new array
        for a padded draft)."""
        ptr = ll.llama_get_logits(self._ctx)
        if self._pairing is not None:
            return self._pairing.rows_in_target_vocab(np.ctypeslib.as_array(ptr, shape=(n_rows, self.model.n_vocab)))
        return np.ctypeslib.as_array(ptr, shape=(n_rows, self.n_vocab))



@dataclass(frozen=True)
class Device:
    name: str
    kind: str  # "cpu" | "gpu" | "igpu" | "accel"
    free_bytes: int
    total_bytes: int


def devices() -> list[Device]:
    """The ggml backend devices llama.cpp would use, with their memory (GPU memory on CUDA)."""
    _init()
    from llama_cpp import _ggml

    lib = _ggml.libggml
    lib.ggml_backend_dev_count.restype = ctypes.c_size_t
    lib.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
    lib.ggml_backend_dev_get.restype = ctypes.c_void_p
    lib.ggml_backend_dev_name.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_dev_name.restype = ctypes.c_char_p
    lib.ggml_backend_dev_type.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_dev_type.restype = ctypes.c_int
    lib.ggml_backend_dev_memory.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t),
                                            ctypes.POINTER(ctypes.c_size_t)]
    lib.ggml_backend_dev_memory.restype = None
    kinds = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel"}
    out = []
    for i in range(lib.ggml_backend_dev_count()):
        dev = lib.ggml_backend_dev_get(i)
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        lib.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        out.append(Device(lib.ggml_backend_dev_name(dev).decode(), kinds.get(lib.ggml_backend_dev_type(dev), "?"),
                          int(free.value), int(total.value)))
    return out


def device_memory(gpu: bool = True) -> tuple[int, str, bool]:
    """(total bytes, name, is a GPU) of the memory the models load into: the first GPU ggml's
    backends list (CUDA, Metal, Vulkan: what llama.cpp offloads to) when `gpu`, else, or without
    one, this machine's RAM. The one probe of `edgespec plan`, the start's memory check and the
    chat models' budget ([models] memory_bytes = 0)."""
    from edgespec.plan import system_memory_bytes

    if gpu:
        gpus = [d for d in devices() if d.kind == "gpu"]
        if gpus:
            return gpus[0].total_bytes, gpus[0].name, True
    return system_memory_bytes(), "RAM", False


# -- EAGLE-3 heads --------------------------------------------------------------------------
# llama-cpp-python 0.3.36 binds llama_batch_ext_* and llama_process but not the layer-feature
# functions; libllama exports them with C++ linkage, so they are bound here by mangled name.

class _Eagle3Lib:
    def __init__(self) -> None:
        from llama_cpp import llama_cpp as _llama

        lib = _llama._lib
        vp, u32, i32, b = ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int32, ctypes.c_bool
        fp = ctypes.POINTER(ctypes.c_float)

        def fn(mangled: str, args: list, res):
            f = getattr(lib, mangled)
            f.argtypes, f.restype = args, res
            return f

        self.set_layer_inp = fn("_Z30llama_set_embeddings_layer_inpP13llama_contextjb", [vp, u32, b], None)
        self.get_layer_inp = fn("_Z30llama_get_embeddings_layer_inpP13llama_contextj", [vp, u32], fp)
        self.set_nextn = fn("_Z26llama_set_embeddings_nextnP13llama_contextbb", [vp, b, b], None)
        self.get_nextn = fn("_Z26llama_get_embeddings_nextnP13llama_context", [vp], fp)
        self.get_nextn_ith = fn("_Z30llama_get_embeddings_nextn_ithP13llama_contexti", [vp, i32], fp)
        self.layer_ids = fn("_Z28llama_model_target_layer_idsPK11llama_model", [vp], ctypes.POINTER(i32))
        self.layer_ids_n = fn("_Z30llama_model_target_layer_ids_nPK11llama_model", [vp], u32)


_e3: _Eagle3Lib | None = None


def _eagle3() -> _Eagle3Lib:
    global _e3
    if _e3 is None:
        _e3 = _Eagle3Lib()
    return _e3


def model_meta(model: Model, key: str) -> str | None:
    """A GGUF metadata value of a loaded model as text (None when absent)."""
    buf = ctypes.create_string_buffer(1024)
    n = ll.llama_model_meta_val_str(model._model, key.encode(), buf, len(buf))
    return buf.value.decode(errors="replace") if n >= 0 else None


def model_arch(model: Model) -> str:
    return model_meta(model, "general.architecture") or "?"


def target_layer_ids(model: Model) -> tuple[int, ...]:
    """The target layers an EAGLE-3 head reads (`<arch>.target_layers`); () for other models."""
    e3 = _eagle3()
    n = int(e3.layer_ids_n(model._model))
    if n == 0:
        return ()
    p = e3.layer_ids(model._model)
    return tuple(int(p[i]) for i in range(n))


def _rows(ptr, n: int, width: int) -> np.ndarray:
    return np.ctypeslib.as_array(ptr, shape=(n, width))


class FeatureContext(Context):
    """A target context that also outputs the inputs of chosen layers (the hidden state entering
    layer `lid`, for every token of a decode, output row or not), the features an EAGLE-3 head
    reads. Its logits are a plain Context's, bit for bit (tests/heads/test_engine_head.py).

    The features of a forward are rows of that llama_decode call only, so `decode_rows` (which
    may run several calls: n_batch pieces, or the CPU's verification chunks) copies each call's
    rows as it goes: `collected()` gives them all, in batch order, until the next decode_rows."""

    def __init__(self, model: Model, cfg: ModelConfig, layers: Sequence[int], n_seq_max: int = 1,
                 n_ctx: int | None = None):
        super().__init__(model, cfg, n_seq_max, n_ctx)
        self.layers = tuple(int(x) for x in layers)
        for lid in self.layers:
            if not 0 <= lid < model.n_layer:
                raise ModelError(f"feature layer {lid} out of range: {model.path.name} has layers 0..{model.n_layer - 1}")
        e3 = _eagle3()
        for lid in sorted(set(self.layers)):
            e3.set_layer_inp(self._ctx, lid, True)
        self._last_rows = 0
        self._collected: list[np.ndarray] | None = None  # while a decode_rows call runs
        self._rows_features: list[np.ndarray] = []  # the last decode_rows call's

    @property
    def n_features(self) -> int:
        return len(self.layers) * self.model.n_embd

    def layer_rows(self, k: int) -> np.ndarray:
        """[tokens of the last llama_decode call, n_embd] input of layer `layers[k]` (a view; rows
        in batch order within the last sub-batch)."""
        ptr = _eagle3().get_layer_inp(self._ctx, self.layers[k])
        if not ptr:
            raise ModelError(f"no features for layer {self.layers[k]}")
        return _rows(ptr, self._last_rows, self.model.n_embd)

    def features(self, rows: Sequence[int] | np.ndarray | slice = slice(None)) -> np.ndarray:
        """[len(rows), len(layers) * n_embd] the chosen rows of the last llama_decode call, the
        layers' inputs concatenated low to high (the head's `g` input; a copy)."""
        return np.concatenate([self.layer_rows(k)[rows] for k in range(len(self.layers))], axis=1)

    def _decoded(self, m: int) -> None:
        self._last_rows = m
        if self._collected is not None:
            self._collected.append(self.features())

    def decode_rows(self, tokens, positions, seq_ids, logits) -> np.ndarray:
        self._collected = []
        try:
            return super().decode_rows(tokens, positions, seq_ids, logits)
        finally:
            self._rows_features, self._collected = self._collected, None

    def collected(self) -> np.ndarray:
        """[tokens of the last decode_rows call, n_features] their features, in batch order."""
        parts = self._rows_features
        if not parts:
            return np.empty((0, self.n_features), np.float32)
        return parts[0] if len(parts) == 1 else np.concatenate(parts)


def check_head(target: Model, head: Model) -> None:
    """An EAGLE-3 head must read layers the target has, of the target's width, and speak its
    vocabulary. Raises IncompatibleDraft naming what differs."""
    arch = model_arch(head)
    if arch != "eagle3":
        raise IncompatibleDraft(f"{head.path.name} is not an EAGLE-3 head (architecture {arch!r})")
    diffs = []
    hidden = model_meta(head, "eagle3.target_hidden_size")
    if hidden is None or int(hidden) != target.n_embd:
        diffs.append(f"target hidden size {hidden} vs the target's n_embd {target.n_embd}")
    ids = target_layer_ids(head)
    bad = [i for i in ids if not 0 <= i < target.n_layer]
    if len(ids) != 3 or bad:
        diffs.append(f"target layer ids {list(ids)} out of range 0..{target.n_layer - 1}")
    if head.n_vocab != target.n_vocab:
        diffs.append(f"vocab size {head.n_vocab} vs {target.n_vocab}")
    elif head.vocab_type != target.vocab_type:
        diffs.append(f"vocab type {head.vocab_type} vs {target.vocab_type}")
    else:
        for t in range(target.n_vocab):
            a, b = target.token_text(t), head.token_text(t)
            if a != b:
                diffs.append(f"token {t} text {a!r} vs {b!r}")
                break
    if diffs:
        raise IncompatibleDraft(f"head {head.path.name} cannot draft for target {target.path.name}: " + "; ".join(diffs))


@dataclass
class HeadRows:
    """A head forward's output rows, in batch order: what drafting reads back."""

    logits: np.ndarray  # [n, vocab] (-inf outside the draft vocabulary)
    hidden: np.ndarray  # [n, head n_embd] pre-norm outputs: the next position's g while drafting

    def __len__(self) -> int:
        return len(self.logits)

    def __getitem__(self, sl: slice) -> HeadRows:
        return HeadRows(self.logits[sl], self.hidden[sl])


class HeadContext(_Decoding):
    """An EAGLE-3 head's context. It shares the target's token embeddings (and lm_head when the
    head has none) through llama.cpp's `ctx_other`: `target` must outlive it.

    Convention (llama.cpp's common/speculative): at head position P the input is the pair
    (token[P+1], g[P]), g[P] = fc(target features at P) from `encode`, or, while drafting, the
    head's own pre-norm output at P-1 (`hidden`). Its logits at P predict token[P+2]; they are
    over the target's vocabulary (-inf outside a reduced draft vocabulary `d2t`)."""

    def __init__(self, head: Model, target: Context, cfg: ModelConfig, n_seq_max: int = 1,
                 n_ctx: int | None = None):
        check_head(target.model, head)
        self.model = head
        self.target = target
        self.n_seq_max = n_seq_max
        self.forward_widths = Counter()  # never padded: its batch_ext forwards keep their widths
        self.layers = target_layer_ids(head)
        cp = _context_params(cfg, n_seq_max, n_ctx)
        cp.flash_attn_type = ll.llama_context_default_params().flash_attn_type
        cp.ctx_other = target._ctx
        self._ctx = ll.llama_init_from_model(head._model, cp)
        if not self._ctx:
            raise ModelError(f"llama.cpp could not create a context for the head {head.path}")
        self.n_ctx = int(ll.llama_n_ctx(self._ctx))
        self.n_batch = cfg.n_batch
        self.n_embd: int = head.n_embd
        self.n_vocab: int = head.n_vocab
        self._mem = ll.llama_get_memory(self._ctx)
        _eagle3().set_nextn(self._ctx, True, True)
        self._batch: Any = ll.llama_batch_ext_init(self._ctx)
        self._keep: list[np.ndarray] = []
        self.decode_seconds = 0.0

    def _embd(self, rows: np.ndarray) -> ll.llama_embd:
        rows = np.ascontiguousarray(rows, dtype=np.float32)
        self._keep.append(rows)
        return ll.llama_embd(rows.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), rows.shape[0], rows.shape[1])

    def encode(self, features: np.ndarray) -> np.ndarray:
        """[n, 3 * target n_embd] target features -> [n, n_embd] g (the head's fc; a copy)."""
        features = np.ascontiguousarray(features, dtype=np.float32)
        out = np.empty((len(features), self.n_embd), np.float32)
        for start in range(0, len(features), self.n_batch):
            chunk = features[start:start + self.n_batch]
            ll.llama_batch_ext_clear(self._batch)
            self._keep = []
            pos = (ll.llama_pos * 1)()
            base = self.pos_max(0) + 1  # the encoder ignores positions; the batch check wants them after seq 0's
            for j in range(len(chunk)):
                idx = ll.llama_batch_ext_add_embd(self._batch, 0, self._embd(chunk[j:j + 1]))
                if idx < 0:
                    raise ModelError(f"head encode: batch add failed ({idx})")
                pos[0] = base + j
                ll.llama_batch_ext_set_pos(self._batch, idx, pos)
                ll.llama_batch_ext_set_output_embd(self._batch, idx, True)
            rc = ll.llama_process(self._ctx, ll.LLAMA_PROCESS_TYPE_ENCODE, self._batch)
            if rc != 0:
                raise ModelError(f"head encode failed with code {rc}")
            out[start:start + len(chunk)] = _rows(_eagle3().get_nextn(self._ctx), len(chunk), self.n_embd)
        return out

    def decode(self, tokens: Sequence[int], positions: Sequence[int], seq_ids: Sequence[Sequence[int]],
               g: np.ndarray, logits: Sequence[bool] | None = None) -> None:
        """Head forwards (one per n_batch piece): entry i is (tokens[i], g[i]) at positions[i] in
        seqs seq_ids[i]. Logits and pre-norm outputs are kept for every entry of the last piece
        (`logits` is accepted for symmetry with Context.decode): read them by batch index."""
        n = len(tokens)
        g = np.ascontiguousarray(g, dtype=np.float32).reshape(n, self.n_embd)
        self._decode_pieces(tokens, positions, seq_ids, [True] * n if logits is None else logits, embd=g)

    def _fill(self, tokens, positions, seq_ids, logits, embd) -> None:
        ll.llama_batch_ext_clear(self._batch)
        self._keep = [embd]
        pos = (ll.llama_pos * 1)()
        for i in range(len(tokens)):
            s = seq_ids[i]
            idx = ll.llama_batch_ext_add_token(self._batch, s[0], int(tokens[i]))
            if idx < 0:
                raise ModelError(f"head decode: batch add failed ({idx})")
            for extra in s[1:]:
                ll.llama_batch_ext_add_seq(self._batch, idx, extra)
            pos[0] = int(positions[i])
            ll.llama_batch_ext_set_pos(self._batch, idx, pos)
            ll.llama_batch_ext_set_embd_token(self._batch, idx, ll.llama_embd(
                embd[i:i + 1].ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, self.n_embd))
            # every row is an output: llama.cpp fills the eagle3 pre-norm rows (`hidden`) in batch
            # order but indexes them by output, so they only line up when all rows are outputs
            ll.llama_batch_ext_set_output_logits(self._batch, idx, True)

    def _forward(self, m: int) -> int:
        return ll.llama_process(self._ctx, ll.LLAMA_PROCESS_TYPE_DECODE, self._batch)

    def _free_batch(self) -> None:
        ll.llama_batch_ext_free(self._batch)

    def decode_rows(self, tokens: Sequence[int], positions: Sequence[int], seq_ids: Sequence[Sequence[int]],
                    logits: Sequence[bool], embd: np.ndarray | None = None) -> HeadRows:
        """Like Context.decode_rows, with `embd` [n, n_embd] the g of every entry: the logits and
        pre-norm outputs of the entries marked in `logits`, in batch order (copies)."""
        n = len(tokens)
        embd = np.ascontiguousarray(embd, dtype=np.float32).reshape(n, self.n_embd)
        lg, hid = [], []
        for start in range(0, n, self.n_batch):
            m = min(self.n_batch, n - start)
            sl = slice(start, start + m)
            self.decode(tokens[sl], positions[sl], seq_ids[sl], embd[sl])
            for j in (j for j in range(m) if logits[start + j]):
                lg.append(self.logits(j).copy())
                hid.append(self.hidden(j).copy())
        if not lg:
            return HeadRows(np.empty((0, self.n_vocab), np.float32), np.empty((0, self.n_embd), np.float32))
        return HeadRows(np.stack(lg), np.stack(hid))

    def logits(self, j: int) -> np.ndarray:
        """[vocab] logits of the j-th output of the last decode (-1 = last; a view)."""
        ptr = ll.llama_get_logits_ith(self._ctx, j)
        if not ptr:
            raise ModelError(f"no head logits for output {j}")
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))

    def hidden(self, j: int) -> np.ndarray:
        """[n_embd] pre-norm output of the j-th output of the last decode: the next position's
        g while drafting (a view)."""
        ptr = _eagle3().get_nextn_ith(self._ctx, j)
        if not ptr:
            raise ModelError(f"no head hidden state for output {j}")
        return np.ctypeslib.as_array(ptr, shape=(self.n_embd,))


_rpc_lock = threading.Lock()
_rpc_added: set[str] = set()  # mirrors ggml's own process-wide device registry


def add_rpc_servers(endpoints: Sequence[str]) -> list[Device]:
    """Register llama.cpp `rpc-server`s (host:port) as ggml devices, as llama.cpp's own
    `--rpc` does: every model loaded afterwards with n_gpu_layers != 0 spreads its layers over
    them (and any local GPU) by their free memory. Needs a wheel built with RPC=1 (GGML_RPC)."""
    _init()
    from llama_cpp import _ggml

    lib = _ggml.libggml
    lib.ggml_backend_reg_by_name.argtypes = [ctypes.c_char_p]
    lib.ggml_backend_reg_by_name.restype = ctypes.c_void_p
    lib.ggml_backend_reg_get_proc_address.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    lib.ggml_backend_reg_get_proc_address.restype = ctypes.c_void_p
    lib.ggml_backend_register.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_register.restype = None
    reg = lib.ggml_backend_reg_by_name(b"RPC")
    add = lib.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_rpc_add_server") if reg else None
    if not add:
        raise ModelError("target.rpc_servers: this llama.cpp build has no RPC backend "
                         "(rebuild the wheel with `make install RPC=1`, i.e. -DGGML_RPC=ON)")
    add_server = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p)(add)
    with _rpc_lock:
        for ep in endpoints:
            if ep in _rpc_added:
                continue
            _probe(ep)  # ggml aborts the whole process when it cannot reach an endpoint
            server_reg = add_server(ep.encode())
            if not server_reg:
                raise ModelError(f"target.rpc_servers: cannot reach the rpc-server at {ep}")
            lib.ggml_backend_register(server_reg)
            _rpc_added.add(ep)
    return [d for d in devices() if d.name.upper().startswith("RPC")]


def _probe(endpoint: str, timeout: float = 10.0) -> None:
    import socket

    host, _, port = endpoint.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            pass
    except (OSError, ValueError) as exc:
        raise ModelError(f"target.rpc_servers: cannot reach the rpc-server at {endpoint} ({exc})") from None


def has_rpc() -> bool:
    """Whether this llama.cpp build has the RPC backend (a wheel built with RPC=1)."""
    _init()
    from llama_cpp import _ggml

    lib = _ggml.libggml
    lib.ggml_backend_reg_by_name.argtypes = [ctypes.c_char_p]
    lib.ggml_backend_reg_by_name.restype = ctypes.c_void_p
    return bool(lib.ggml_backend_reg_by_name(b"RPC"))


POOLING = {"auto": ll.LLAMA_POOLING_TYPE_UNSPECIFIED, "mean": ll.LLAMA_POOLING_TYPE_MEAN,
           "cls": ll.LLAMA_POOLING_TYPE_CLS, "last": ll.LLAMA_POOLING_TYPE_LAST}
_POOLING_NAMES = {v: k for k, v in POOLING.items()}


def packed(inputs: Sequence[Sequence[int]], n_seq_max: int, n_batch: int, what: str,
           outputs: Sequence[int] | None = None, max_outputs: int = 0) -> list[list[int]]:
    """The inputs' indices in groups of at most n_seq_max sequences and n_batch tokens, in order
    (one forward each: a sequence per input); and, given `outputs` (rows of logits input i asks
    for), at most max_outputs rows per group."""
    groups: list[list[int]] = []
    i = 0
    while i < len(inputs):
        group: list[int] = []
        size = rows = 0
        while (i < len(inputs) and len(group) < n_seq_max and size + len(inputs[i]) <= n_batch
               and (outputs is None or rows + outputs[i] <= max_outputs)):
            group.append(i)
            size += len(inputs[i])
            rows += outputs[i] if outputs is not None else 0
            i += 1
        if not group:
            raise ModelError(f"input of {len(inputs[i])} tokens exceeds the {what} batch ({n_batch})")
        groups.append(group)
    return groups


def sequences_batch(seqs: Sequence[Sequence[int]], last_only: bool,
                    tails: Sequence[int] | None = None) -> tuple[Any, list[int]]:
    """A llama_batch (the caller frees it) of one sequence per entry of `seqs` (sequence id = its
    index, positions from 0), every token's output asked for, or each sequence's last only, or
    (`tails`) the outputs of sequence s's last tails[s] positions; and each sequence's last
    token's index in the batch (its first token's is last[s] - len(seqs[s]) + 1)."""
    batch = ll.llama_batch_init(sum(len(q) for q in seqs), 0, 1)
    k, last = 0, []
    for s, seq in enumerate(seqs):
        first_out = len(seq) - (tails[s] if tails is not None else 1 if last_only else len(seq))
        for p, t in enumerate(seq):
            batch.token[k] = t
            batch.pos[k] = p
            batch.n_seq_id[k] = 1
            batch.seq_id[k][0] = s
            batch.logits[k] = p >= first_out
            k += 1
        last.append(k - 1)
    batch.n_tokens = k
    return batch, last


class EmbeddingContext:
    """Pooled, L2-normalised embeddings of whole token sequences: a context of its own with
    llama.cpp's embeddings on, over any loaded Model (an [embedding] model, or the target's
    weights shared). Pooling `auto`: the GGUF's `<arch>.pooling_type`, mean when it has none (a
    decoder LM). Several inputs share a batch, one sequence each; the cache is cleared after
    each batch. One caller at a time (the daemon holds a lock)."""

    def __init__(self, model: Model, cfg: ModelConfig, pooling: str = "auto", n_seq_max: int = 16):
        self.model = model
        self.n_seq_max = n_seq_max
        cp = _context_params(cfg, n_seq_max, None)
        cp.embeddings = True
        cp.pooling_type = POOLING[pooling]
        self._ctx = ll.llama_init_from_model(model._model, cp)
        if self._ctx and ll.llama_pooling_type(self._ctx) == ll.LLAMA_POOLING_TYPE_NONE:
            ll.llama_free(self._ctx)  # no pooling in the GGUF: mean
            cp.pooling_type = ll.LLAMA_POOLING_TYPE_MEAN
            self._ctx = ll.llama_init_from_model(model._model, cp)
        if not self._ctx:
            raise ModelError(f"llama.cpp could not create an embedding context for {model.path}")
        self.pooling = _POOLING_NAMES.get(int(ll.llama_pooling_type(self._ctx)), "auto")
        self.n_ctx = int(ll.llama_n_ctx(self._ctx))
        self.n_batch = cfg.n_batch
        self.n_embd = model.n_embd
        self._mem = ll.llama_get_memory(self._ctx)

    def embed(self, inputs: Sequence[Sequence[int]]) -> np.ndarray:
        """[len(inputs), n_embd] float32, each row of unit length. Each input must hold at
        least one token and at most min(n_ctx, n_batch) (checked by the caller)."""
        out = np.zeros((len(inputs), self.n_embd), dtype=np.float32)
        for group in packed(inputs, self.n_seq_max, self.n_batch, "embedding"):
            batch, _ = sequences_batch([inputs[j] for j in group], last_only=False)
            try:
                rc = ll.llama_decode(self._ctx, batch)
                if rc != 0:
                    raise ModelError(f"llama_decode failed with code {rc} (embedding batch of {batch.n_tokens} tokens)")
                for s, j in enumerate(group):
                    ptr = ll.llama_get_embeddings_seq(self._ctx, s)
                    if not ptr:
                        raise ModelError("llama.cpp returned no pooled embedding")
                    v = np.ctypeslib.as_array(ptr, shape=(self.n_embd,)).astype(np.float32)
                    norm = float(np.linalg.norm(v))
                    out[j] = v / norm if norm > 0 else v
            finally:
                ll.llama_batch_free(batch)
                ll.llama_memory_clear(self._mem, True)
        return out

    def close(self) -> None:
        if getattr(self, "_ctx", None):
            ll.llama_free(self._ctx)
            self._ctx = None

    def __del__(self) -> None:  # pragma: no cover
        try:
            self.close()
        except Exception:
            pass


RERANK_KINDS = ("cross-encoder", "causal-yes-no", "causal-query-likelihood")
CLASSIFIER_TENSORS = frozenset({"cls.weight", "cls.output.weight"})  # llama.cpp's LLM_TENSOR_CLS, _CLS_OUT


def has_classifier_head(names: Iterable[str]) -> bool:
    """Whether a GGUF's tensor names hold a sequence-classification head (llama.cpp's `cls`, the
    dense layer of RoBERTa's head, or `cls.output`, the projection to the scores): what
    llama.cpp's converter writes for a *ForSequenceClassification checkpoint (BGE, ms-marco
    MiniLM and Jina rerankers), with or without a pooling type in the metadata."""
    return any(n in CLASSIFIER_TENSORS for n in names)


def rank_kind(model: Model) -> str:
    """The reranker a GGUF is: "cross-encoder" when its `<arch>.pooling_type` is rank or it
    carries a classifier head (llama.cpp's converter writes the head of BGE and ms-marco
    rerankers but no pooling type; llama-server is told `--reranking`), else "causal-yes-no"
    (a causal LM, scored by its yes/no logits)."""
    pooling = model_meta(model, f"{model_arch(model)}.pooling_type")
    if pooling is not None and pooling.strip() == str(int(ll.LLAMA_POOLING_TYPE_RANK)):
        return "cross-encoder"
    return "cross-encoder" if has_classifier_head(n for n, _ in tensor_table(model.path)) else "causal-yes-no"


class RankContext:
    """Scores of whole token sequences (query and document already joined by the caller), many
    sequences in one forward (one sequence id each); the cache is cleared after each batch. One
    caller at a time (the reranker's worker thread).

    cross-encoder: llama.cpp's rank pooling (the GGUF's classifier head); score = sigmoid of the
    head's first output, in [0, 1].
    causal-yes-no: the LM's logits at each sequence's last position; score =
    p(yes) / (p(yes) + p(no)) = sigmoid(logit[yes] - logit[no]), in [0, 1], as Qwen3-Reranker is read.
    causal-query-likelihood: the sequence ends with the query; score = the mean over its last
    `scored` tokens q_1..q_m of log p(q_j | everything before q_j), a log-probability <= 0
    (query likelihood, Sachan et al. 2022)."""

    def __init__(self, model: Model, cfg: ModelConfig, kind: str, yes_no: tuple[int, int] = (-1, -1),
                 n_seq_max: int = 64):
        if kind not in RERANK_KINDS:
            raise ModelError(f"unknown reranker kind {kind!r} (known: {', '.join(RERANK_KINDS)})")
        if kind == "cross-encoder" and rank_kind(model) != "cross-encoder":
            # llama.cpp aborts the process on rank pooling without a classifier head: refuse first
            raise ModelError(f"{model.path} has no classifier head (no cls tensors, pooling_type not rank): "
                             "not a cross-encoder; use kind = \"causal-yes-no\"")
        self.model, self.kind, self.yes_no, self.n_seq_max = model, kind, yes_no, n_seq_max
        cp = _context_params(cfg, n_seq_max, None)
        if kind == "cross-encoder":
            cp.embeddings = True
            cp.pooling_type = ll.LLAMA_POOLING_TYPE_RANK
        self._ctx = ll.llama_init_from_model(model._model, cp)
        if not self._ctx:
            raise ModelError(f"llama.cpp could not create a rerank context for {model.path}")
        self.n_ctx = int(ll.llama_n_ctx(self._ctx))
        self.n_batch = cfg.n_batch
        self._mem = ll.llama_get_memory(self._ctx)

    def score(self, inputs: Sequence[Sequence[int]], scored: Sequence[int] | None = None) -> np.ndarray:
        """[len(inputs)] float64 scores. Each input holds 1 .. min(n_ctx, n_batch) tokens (checked
        by the caller); inputs are packed greedily, n_seq_max and n_batch tokens per forward.
        causal-query-likelihood: `scored[i]` (1 .. QUERY_LIKELIHOOD_ROWS, and < len(inputs[i]))
        trailing tokens of input i are scored, at most QUERY_LIKELIHOOD_ROWS per forward."""
        out = np.zeros(len(inputs), dtype=np.float64)
        ql = self.kind == "causal-query-likelihood"
        if ql and (scored is None or len(scored) != len(inputs)
                   or not all(0 < m <= QUERY_LIKELIHOOD_ROWS and m < len(x) for m, x in zip(scored, inputs))):
            raise ModelError(f"query likelihood needs 1 .. {QUERY_LIKELIHOOD_ROWS} scored tokens after at least one "
                             "other per input")
        for group in packed(inputs, self.n_seq_max, self.n_batch, "rerank", scored if ql else None,
                            QUERY_LIKELIHOOD_ROWS):
            self._forward([inputs[j] for j in group], out, group, [scored[j] for j in group] if scored else None)
        return out

    def _forward(self, seqs: Sequence[Sequence[int]], out: np.ndarray, rows: Sequence[int],
                 scored: Sequence[int] | None) -> None:
        ql = self.kind == "causal-query-likelihood" and scored is not None
        # query likelihood reads the logits before each scored token; the last token's predict
        # nothing and (causal attention) change no earlier row: it is not fed
        fed = [q[:-1] for q in seqs] if ql else seqs
        batch, last = sequences_batch(fed, last_only=self.kind == "causal-yes-no", tails=scored if ql else None)
        try:
            rc = ll.llama_decode(self._ctx, batch)
            if rc != 0:
                raise ModelError(f"llama_decode failed with code {rc} (rerank batch of {batch.n_tokens} tokens)")
            for s, row in enumerate(rows):
                if ql and scored is not None:
                    m = scored[s]
                    out[row] = self._mean_log_prob(seqs[s][-m:], last[s] - m + 1)
                else:
                    out[row] = 1.0 / (1.0 + np.exp(-self._margin(s, last[s])))
        finally:
            ll.llama_batch_free(batch)
            if self._mem:  # an encoder-only cross-encoder keeps no cache
                ll.llama_memory_clear(self._mem, True)

    def _margin(self, s: int, last: int) -> float:
        if self.kind == "causal-yes-no":
            ptr = ll.llama_get_logits_ith(self._ctx, last)
            if not ptr:
                raise ModelError("llama.cpp returned no logits")
            yes, no = self.yes_no
            return float(ptr[yes]) - float(ptr[no])  # log p(yes) - log p(no)
        ptr = ll.llama_get_embeddings_seq(self._ctx, s)
        if not ptr:
            raise ModelError("llama.cpp returned no rank score")
        return float(ptr[0])

    def _mean_log_prob(self, tokens: Sequence[int], first: int) -> float:
        """Mean of log p(tokens[j] | before it), the logits of batch row first + j predicting it."""
        total = 0.0
        for j, t in enumerate(tokens):
            ptr = ll.llama_get_logits_ith(self._ctx, first + j)
            if not ptr:
                raise ModelError("llama.cpp returned no logits")
            logits = np.ctypeslib.as_array(ptr, shape=(self.model.n_vocab,)).astype(np.float64)
            top = float(logits.max())
            total += float(logits[t]) - top - float(np.log(np.exp(logits - top).sum()))
        return total / len(tokens)

    def close(self) -> None:
        if getattr(self, "_ctx", None):
            ll.llama_free(self._ctx)
            self._ctx = None

    def __del__(self) -> None:  # pragma: no cover
        try:
            self.close()
        except Exception:
            pass
