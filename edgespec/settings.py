"""Every configuration setting, declared once: section, key, type, default, range, help.

The daemon's frozen config sections, their validation, `edgespec config defaults`,
`edgespec config reference` (docs/configuration.md), the CLI defaults of `generate` and the
speculation defaults of gRPC/HTTP requests are all derived from `SETTINGS`. The request fields
a client sets (sampling, speculation) are declared the same way in `SAMPLING` / `SPECULATION`
and checked in one place (`check_fields`).

No heavy imports: the engine's own types (types.py, sampling.py, config.py) read it.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from edgespec.errors import BadRequest

# the tool-call formats edgespec.tool_formats reads and writes (its FORMATS)
TOOL_FORMATS = ("hermes", "qwen3_coder", "glm45", "llama3", "mistral", "mistral_v11", "deepseek_r1", "deepseek_v31")

# the limits a request's speculation shape may reach
MAX_DRAFT_TOKENS = 16
MAX_TREE_NODES = 64
MAX_TREE_DEPTH = 16
MAX_STOP_STRINGS = 16
KV_TYPES = ("f16", "q8_0", "q4_0", "f32")
SPEC_MODES = ("auto", "off", "plain", "chain", "tree")
SUFFIX_STORES = ("output", "prompt_and_output")
SUFFIX_SCOPES = ("caller", "pooled")
CONTROLLER_MAX_DEPTH = 16  # draft levels a controller shape may have
CONTROLLER_MAX_NODES = 128  # verification nodes (excluding the root)
CONTROLLER_MAX_WIDTH = 8  # children per expanded node / ranks tracked by the acceptance model

Check = Callable[[Any], "str | None"]  # an extra check: an error message or None


@dataclass(frozen=True)
class Setting:
    """One key: the types TOML may give it, its default, the range or choices it must lie in
    (open ends with lo_open / hi_open), an extra check, and what it does."""

    section: str
    key: str
    types: tuple[type, ...]
    default: Any
    help: str
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    choices: tuple[Any, ...] = ()
    check: Check | None = None
    hi_text: str = ""  # how the docs and messages write `hi` (2^63)

    @property
    def name(self) -> str:
        """How messages name it: the TOML dotted key, `server.parallel` for `[server] parallel`."""
        return f"{self.section}.{self.key}"

    @property
    def type_text(self) -> str:
        types = [t for t in self.types if not (t is int and float in self.types)]  # a number may be written 3
        return " or ".join(_TYPE_NAMES.get(t, t.__name__) for t in types)

    def range_text(self) -> str:
        """[1, 16], (0, 1], >= 0, one of a, b; "" when anything of its type goes."""
        if self.choices:
            return "one of " + ", ".join(_text(c) for c in self.choices)
        if self.types == (bool,):
            return "true or false"
        if self.check is not None and self.check in CHECK_TEXT:
            return CHECK_TEXT[self.check]
        hi = self.hi_text or (None if self.hi is None else _num(self.hi))
        if self.lo is not None and hi is not None:
            return f"{'(' if self.lo_open else '['}{_num(self.lo)}, {hi}{')' if self.hi_open else ']'}"
        if self.lo is not None:
            return f"{'>' if self.lo_open else '>='} {_num(self.lo)}"
        if hi is not None:
            return f"{'<' if self.hi_open else '<='} {hi}"
        return ""

    def problem(self, value: Any) -> str | None:
        """What is wrong with `value` for this key (type, range, choices, extra check), or None."""
        if not _has_type(value, self.types):
            article = "an" if self.type_text[0] in "aeiou" else "a"
            return f"must be {article} {self.type_text}, got {type(value).__name__} {value!r}"
        if self.choices and value not in self.choices:
            return f"must be {self.range_text()}, got {value!r}"
        if isinstance(value, (int, float)) and not isinstance(value, bool) and not self._in_range(value):
            rng = self.range_text()
            return f"must be {'finite' if not rng else rng if rng[0] in '<>' else 'in ' + rng}, got {value!r}"
        return self.check(value) if self.check else None

    def _in_range(self, v: float) -> bool:
        if not math.isfinite(v):
            return False
        if self.lo is not None and (v <= self.lo if self.lo_open else v < self.lo):
            return False
        return self.hi is None or not (v >= self.hi if self.hi_open else v > self.hi)


_TYPE_NAMES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "list"}


def _has_type(v: Any, types: tuple[type, ...]) -> bool:
    if isinstance(v, bool):
        return bool in types
    if isinstance(v, int) and float in types:
        return True
    return isinstance(v, types)


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() and not isinstance(v, float) else repr(v)


def _text(v: Any) -> str:
    return ("true" if v else "false") if isinstance(v, bool) else str(v)


# ---- extra checks: an error message or None -------------------------------------------------


def check_host(v: str) -> str | None:
    if not v:
        return "must not be empty"
    if v == "localhost":
        return None
    try:
        ipaddress.ip_address(v.strip("[]"))
    except ValueError:
        if not all(part and part.replace("-", "").isalnum() for part in v.split(".")):
            return f"is not an IP address or host name: {v!r}"
    return None


def _file_or_empty(v: str) -> str | None:
    if v and not Path(v).expanduser().is_file():
        return f"file not found: {v}"
    return None


def _head_choice(v: str) -> str | None:
    if v not in ("auto", "none") and not Path(v).expanduser().is_file():
        return f"must be auto, none or an existing head GGUF file, got {v!r}"
    return None


def _caller_limits(v: list) -> str | None:
    for x in v:
        who, _, caps = str(x).rpartition("=")
        parts = caps.split("/")
        if not who.strip() or len(parts) not in (2, 3) or not all(p.strip().isdigit() for p in parts):
            return f"each must be IDENTITY=CONCURRENT/TOKENS_PER_MINUTE or IDENTITY=CONCURRENT/QUEUED/TOKENS_PER_MINUTE, got {x!r}"
    return None


def _strings(v: list) -> str | None:
    bad = [x for x in v if not isinstance(x, str) or not x.strip()]
    return f"must be a list of non-empty strings, got {bad[0]!r}" if bad else None


def _subjects(v: list) -> str | None:
    """[auth] admin_subjects: each entry a full subject (RFC 4514, "CN=ops,O=site") or `CN:<name>`
    for any certificate of that common name; a bare name is neither (it used to match a CN)."""
    if bad := _strings(v):
        return bad
    for x in v:
        if not x.startswith("CN:") and "=" not in x:
            return f"each entry is a full subject (\"CN=ops,O=site\") or \"CN:<common name>\", got {x!r}"
        if x.startswith("CN:") and not x[3:].strip():
            return f"\"CN:\" needs a common name, got {x!r}"
    return None


def _endpoints(v: list) -> str | None:
    for x in v:
        host, sep, port = str(x).rpartition(":") if isinstance(x, str) else ("", "", "")
        if not sep or not port.isdigit() or not 0 < int(port) < 65536 or check_host(host.strip("[]")):
            return f"must be a list of host:port, got {x!r}"
    return None


def _json_mode(v: Any) -> str | None:
    return None if v in ("auto", True, False) else f"must be \"auto\", true or false, got {v!r}"


CHECK_TEXT: dict[Any, str] = {  # how the docs write what an extra check allows
    check_host: "an IP address or host name",
    _file_or_empty: "an existing file, or empty",
    _head_choice: "auto, none, or an existing file",
    _strings: "non-empty strings",
    _subjects: "subjects (\"CN=x,O=y\") or \"CN:name\" entries",
    _caller_limits: "IDENTITY=CONCURRENT[/QUEUED]/TOKENS_PER_MINUTE strings",
    _endpoints: "host:port entries",
    _json_mode: "\"auto\", true or false",
}


# ---- the declaration ------------------------------------------------------------------------

# the TOML types a key takes: integer, number (an integer too), boolean, string, list
I, F, B, S, L = (int,), (int, float), (bool,), (str,), (list,)


def _model(section: str) -> tuple[Setting, ...]:
    m = partial(Setting, section)
    empty = ("the demo model from `edgespec models prepare-demo`" if section == "target" else
             "the demo draft when the target is the demo's, else none (model-free drafting). A draft with the "
             "target's vocabulary (a padded tail is fine) drafts token for token; one with another tokenizer "
             "drafts through text (its continuation re-tokenized with the target's; output unchanged); a "
             "file with no tokenizer is refused")
    return (
        m("path", S, "", f"GGUF file; empty = {empty}", check=_file_or_empty),
        m("n_gpu_layers", I, 0, "layers offloaded to the GPU (-1 = all; CUDA builds only)", lo=-1),
        m("n_ctx", I, 4096, "context length in tokens (prompt + output)", lo=128, hi=1 << 20),
        m("n_batch", I, 512, "llama.cpp batch size for prompt processing", lo=1, hi=1 << 16),
        m("threads", I, 0, "CPU threads (0 = all cores)", lo=0, hi=1024),
        m("flash_attn", B, True, "use flash attention (its logits do not depend on the other requests' cells "
          "in the shared cache; off: ~1e-2 differences between cache layouts)"),
        m("kv_type", S, "f16", "KV cache type", choices=KV_TYPES),
    )


_server = partial(Setting, "server")
_spec = partial(Setting, "speculation")
_limits = partial(Setting, "limits")
_auth = partial(Setting, "auth")
_tls = partial(Setting, "tls")
_ctl = partial(Setting, "controller")

SETTINGS: tuple[Setting, ...] = (
    _server("host", S, "127.0.0.1", "address to listen on", check=check_host),
    _server("port", I, 50051, "TCP port (0 = pick a free one)", lo=0, hi=65535),
    _server("reflection", B, False, "enable gRPC server reflection"),
    _server("insecure", B, False, "allow a non-loopback address without auth tokens"),
    _server("max_message_bytes", I, 4 << 20, "largest request/response message", lo=1024, hi=1 << 30),
    _server("grace_seconds", F, 30.0, "SIGTERM: time in-flight requests get to finish", lo=0, hi=3600),
    _server("parallel", I, 2, "requests decoded at once (engine slots)", lo=1, hi=64),
    _server("queue_size", I, 16, "requests waiting for a slot; beyond: RESOURCE_EXHAUSTED", lo=0, hi=100000),
    _server("max_tokens", I, 4096, "largest max_tokens a request may ask for", lo=1, hi=1 << 20),
    _server("default_max_tokens", I, 256, "max_tokens when a request leaves it unset", lo=1, hi=1 << 20),
    _server("max_tree_leaves", I, 32, "tree leaves a slot may verify at once (sequence ids of the shared "
            "context; all slots together get at most 256)", lo=1, hi=255),
    _server("prefill_share", F, 1.5, "a prompt is prefilled in pieces inside the engine ticks: beside decoding "
            "streams a piece may add this many times the tick's decode work to the tick's forward (0 = whole "
            "n_batch chunks, the streams wait); the piece that ends a prompt brings the request's first step "
            "along", lo=0, hi=100),
    _server("prompt_cache", B, True, "a slot keeps its last prompt's prefill: a request sharing a prefix "
            "prefills only what follows it (on a CPU with the patched ggml at any length; elsewhere from the "
            "last whole n_batch chunk they share); its draft keeps (and absorbs while idle) the last context, "
            "reusable up to any shared prefix; an EAGLE-3 head keeps its positions and unabsorbed features, "
            "and a request keeps no more of the prefill than the head has"),
    _server("prompt_cache_bytes", I, 256 << 20, "host memory for prompts' prefills beyond the slots (with "
            "prompt_cache): before a slot's kept prefill is dropped for another prompt, its cells (and a head's "
            "positions and features) are copied here, and a later request sharing a longer prefix with one gets "
            "them written back instead of prefilling it again; least recently used first out; 0 = off (restart "
            "to change)", lo=0, hi=1 << 40),
    _server("prompt_cache_scope", S, "caller", "caller: what a caller's requests leave (a slot's kept prefill, "
            "the draft's and head's caches, the prompt store's entries) serves and counts only for that caller "
            "(a token's name, a certificate's subject; anonymous callers share one); pooled (opt-in): any "
            "caller, which lets a caller read off cached_tokens and time whether another sent a prompt that "
            "starts like its own (docs/appliance.md, threat model; restart to change)", choices=SUFFIX_SCOPES),
    *_model("target"),
    Setting("target", "rpc_servers", L, [], "llama.cpp rpc-servers (host:port) that hold part of the target's "
            "layers, for a target larger than one box; needs a wheel built with RPC=1 and n_gpu_layers != 0",
            check=_endpoints),
    Setting("target", "fast_kernels", B, False, "true = a CPU target's quantized weights take ggml's fastest "
            "kernels (repacked Q4_0/Q4_K/IQ4_NL layouts, the tiled K-quant mat-mul): prompts and decoding at "
            "llama.cpp's own speed, but a token's logits then depend on the batch it shares, so outputs are exact "
            "only up to float rounding; false = batch-invariant kernels, bit-exact for the types of "
            "docs/support-matrix.md (restart to change)"),
    Setting("target", "chat_template", S, "", "a Jinja chat template file to render chat requests with (in a "
            "sandbox, with tools) instead of the GGUF's own; empty = the GGUF's tokenizer.chat_template", check=_file_or_empty),
    Setting("target", "tool_format", S, "auto", "the format the model writes tool calls in, which the answer's "
            "grammar and parser follow: auto = the one the chat template writes (Hermes' <tool_call> when it "
            "shows none); hermes, qwen3_coder, glm45, llama3, mistral, mistral_v11, deepseek_r1 or deepseek_v31 to force one",
            choices=("auto", *TOOL_FORMATS)),
    Setting("target", "reasoning_format", S, "auto", "whether the model writes its reasoning in a <think> block "
            "(DeepSeek-R1, Qwen3, QwQ, GLM): think = split it from the content (reasoning_content, a reasoning "
            "item, a thinking block) and hold a schema or tool grammar to what follows it; auto = think when "
            "the chat template knows </think>; none = the answer is all content", choices=("auto", "none", "think")),
    *_model("draft"),
    Setting("draft", "enabled", B, True, "false = model-free (n-gram) drafting only"),
    Setting("draft", "head", S, "auto", "an EAGLE-3 head loaded beside the draft model: each request drafts with "
            "the head or the draft model, whichever the measured forward costs and acceptances promise more "
            "at the load it meets; auto = the head `make models` (`edgespec models prepare-demo`) put beside the demo target, used when "
            "`path` is unset; none = the draft model alone; else a head GGUF file (its context takes this "
            "section's settings)", check=_head_choice),
    Setting("draft", "window", I, 256, "most context tokens the draft absorbs at once: a longer prompt is "
            "drafted from its last `window` tokens", lo=16, hi=1 << 20),
    Setting("embedding", "enabled", B, True, "serve /v1/embeddings and Inference.Embed"),
    Setting("embedding", "path", S, "", "GGUF file of an embedding model; empty = the target's weights (a "
            "context of their own)", check=_file_or_empty),
    Setting("embedding", "pooling", S, "auto", "how token vectors become one: auto = the GGUF's pooling_type "
            "(mean when it has none, as for a decoder LM)", choices=("auto", "mean", "cls", "last")),
    Setting("embedding", "n_ctx", I, 2048, "the embedding context's cells (an input's tokens at most "
            "min(n_ctx, n_batch))", lo=16, hi=1 << 20),
    Setting("embedding", "n_batch", I, 2048, "tokens embedded in one forward (several short inputs share one)",
            lo=16, hi=1 << 20),
    Setting("embedding", "threads", I, 0, "CPU threads (0 = all cores)", lo=0, hi=1024),
    Setting("embedding", "n_gpu_layers", I, 0, "layers offloaded to the GPU when `path` is set (-1 = all)", lo=-1),
    Setting("embedding", "max_inputs", I, 256, "inputs in one request", lo=1, hi=1 << 16),
    Setting("embedding", "name", S, "", "the model's name in /v1/models and in requests' `model`; empty = the "
            "file's name without .gguf, or `<chat model>-embedding` on the target's weights (whose name is "
            "also accepted)"),
    Setting("embedding", "batch_wait_ms", F, 2.0, "how long the first waiting request waits for others to "
            "share its forward (0 = never waits; a full batch goes at once)", lo=0, hi=1000),
    Setting("rerank", "enabled", B, True, "serve /v1/rerank and Inference.Rerank"),
    Setting("rerank", "path", S, "", "GGUF file of a reranker; empty = the target's weights (a context of "
            "their own, scored by query likelihood with kind auto)", check=_file_or_empty),
    Setting("rerank", "kind", S, "auto", "cross-encoder = llama.cpp's rank pooling over the GGUF's "
            "classifier head (BGE/Jina rerankers); causal-yes-no = a causal LM's p(yes) / (p(yes) + p(no)) "
            "at the end of `template`, as Qwen3-Reranker is read; causal-query-likelihood = how likely a "
            "causal LM finds the query after reading the document (zero-shot, for a chat LM that is no "
            "reranker: docs/appliance.md); auto = cross-encoder when the GGUF carries a classifier head (cls "
            "tensors) or its pooling_type is rank, "
            "causal-yes-no when its name says reranker (Qwen3-Reranker), else causal-query-likelihood", choices=("auto", "cross-encoder", "causal-yes-no", "causal-query-likelihood")),
    Setting("rerank", "template", S, "", "causal kinds only: the prompt, with {query} and {document} (and "
            "optionally {instruction}) where they go (special tokens in the template are read as such, "
            "never in the query or document; causal-query-likelihood needs {query} after {document} and "
            "reads nothing after it); empty = the model's chat template over a system turn that asks for "
            "yes or no and a user turn with the instruction, query and document (causal-query-likelihood: "
            "a user turn with the document asking for a question it answers, and the query as the answer)"),
    Setting("rerank", "instruction", S, "Given a web search query, retrieve relevant passages that answer "
            "the query", "causal-yes-no only: the task the template's {instruction} states"),
    Setting("rerank", "name", S, "", "the model's name in /v1/models and in requests' `model`; empty = the "
            "file's name without .gguf, or `<chat model>-rerank` on the target's weights"),
    Setting("rerank", "n_ctx", I, 4096, "the rerank context's cells (a query and document together at most "
            "min(n_ctx, n_batch) tokens)", lo=16, hi=1 << 20),
    Setting("rerank", "n_batch", I, 2048, "tokens scored in one forward (several documents share one)",
            lo=16, hi=1 << 20),
    Setting("rerank", "threads", I, 0, "CPU threads (0 = all cores)", lo=0, hi=1024),
    Setting("rerank", "n_gpu_layers", I, 0, "layers offloaded to the GPU when `path` is set (-1 = all)", lo=-1),
    Setting("rerank", "max_documents", I, 256, "documents in one request", lo=1, hi=1 << 16),
    Setting("rerank", "batch_wait_ms", F, 2.0, "how long the first waiting request waits for others to share "
            "its forward (0 = never waits)", lo=0, hi=1000),
    _spec("policy", S, "auto", "auto: honour request modes; off: force plain decoding", choices=("auto", "off")),
    _spec("mode", S, "auto", "mode used when a request says AUTO", choices=SPEC_MODES),
    _spec("draft_tokens", I, 4, "default chain length", lo=1, hi=MAX_DRAFT_TOKENS),
    _spec("tree_nodes", I, 16, "default tree node budget (excluding the root)", lo=1, hi=MAX_TREE_NODES),
    _spec("tree_depth", I, 6, "default tree depth", lo=1, hi=MAX_TREE_DEPTH),
    _spec("ngram", B, True, "also draft from prompt n-grams"),
    _spec("pad_forwards", (str, bool), "auto", "every target and draft-model forward handed to llama.cpp holds "
          "one of a few fixed widths (1, 2, 4 ... 64; the controller prices each tree at the width it pads "
          "to), the extra tokens inert in a scratch sequence whose cells are removed after the forward: on "
          "a GPU the forward's shape then repeats from step to step and llama.cpp replays it as a CUDA graph; "
          "outputs are unchanged (bit for bit on a CPU). auto = on when the target is offloaded to a GPU "
          "(n_gpu_layers != 0), off on a CPU. Off, a forward is still padded where a wider measured width "
          "costs less than its own (on a CPU, ggml's repacked Q4_0 and Q4_K kernels take 4 tokens at a "
          "time, so 2-3 tokens run as 4) (restart to change)",
          choices=("auto", True, False)),
    _spec("suffix_cache", B, True, "draft from a cross-request suffix cache of recent replies (point drafts: "
          "the output never changes); a request that does not speculate neither reads nor feeds it; false "
          "(SIGHUP) also empties it"),
    _spec("suffix_cache_bytes", I, 64 << 20, "memory bound of the suffix cache (its accounted bytes); the "
          "least recently used replies are evicted beyond it (restart to change)", lo=1 << 16, hi=1 << 40),
    _spec("suffix_cache_store", S, "output", "what the suffix cache keeps of a finished request: its reply "
          "(after its prompt's last 8 tokens) or its prompt and reply (restart to change)",
          choices=SUFFIX_STORES),
    _spec("suffix_cache_scope", S, "caller", "caller: one partition per identity (a token's name, a certificate's "
          "subject; anonymous callers share one), so no caller's drafts come from another's text; pooled: one "
          "for all callers, which lets a caller time whether another's text continues its own "
          "(docs/appliance.md, threat model; restart to change). The prompt lookups' learnt reach is "
          "partitioned alike", choices=SUFFIX_SCOPES),
    _spec("suffix_cache_persist", B, False, "write the suffix cache to the state directory at drain and stop "
          "(a [[chat]] model's also as it unloads) and load it at start or load (bounded, checksummed; a file per "
          "chat model); it holds callers' text on disk"),
    _spec("max_draft_tokens", I, MAX_DRAFT_TOKENS, "largest draft_tokens a request may ask for",
          lo=1, hi=MAX_DRAFT_TOKENS),
    _spec("max_tree_nodes", I, MAX_TREE_NODES, "largest tree_nodes a request may ask for", lo=1, hi=MAX_TREE_NODES),
    _spec("max_tree_depth", I, MAX_TREE_DEPTH, "largest tree_depth a request may ask for", lo=1, hi=MAX_TREE_DEPTH),
    _limits("max_messages", I, 1024, "chat messages in one request (Generate, Tokenize)", lo=1, hi=1 << 20),
    _limits("max_prompt_bytes", I, 1 << 20, "largest prompt in UTF-8 bytes: a prompt, the chat messages' "
            "contents together, or a Tokenize text", lo=1, hi=1 << 30),
    _limits("max_constraint_bytes", I, 64 << 10, "largest structured-output constraint in UTF-8 bytes: a JSON "
            "schema, regex or grammar (a request's own, or the one its tools make); it is compiled in the "
            "request's handler thread, never the engine's", lo=1, hi=1 << 30),
    _limits("constraint_step_seconds", F, 0.5, "the engine thread's CPU time one request's grammar masks may "
            "take in one decoding step (its drafts' and its tree's); past it the request fails with a 400 / "
            "INVALID_ARGUMENT naming its constraint field, and the tick goes on for the others",
            lo=0, hi=60, lo_open=True),
    _limits("constraint_tick_seconds", F, 0.5, "every request's grammar masks together in one engine tick: each "
            "constrained request in the tick may take an equal part of it (and at most "
            "limits.constraint_step_seconds), so `server.parallel` hostile grammars cannot stall a tick "
            "for more than this", lo=0, hi=60, lo_open=True),
    _limits("constraint_burst_seconds", F, 0.25, "one request's grammar masks over its run are paced by a token "
            "bucket of this many seconds of the engine thread's CPU time, refilled at limits.constraint_share: "
            "a request whose bucket lacks its next step (its last step's mask time) sits out ticks, its slot "
            "kept, while the others decode, until the bucket has refilled", lo=0, hi=3600),
    _limits("constraint_share", F, 0.25, "the fraction of the engine thread's CPU time that one request's grammar "
            "masks may take over its run beside other requests (beyond limits.constraint_burst_seconds): a costly "
            "grammar slows to it, and another caller's request of T seconds waits at most about "
            "(burst + share * T) / (1 - share) more for it", lo=0, hi=1, lo_open=True, hi_open=True),
    _limits("constraint_wait_seconds", F, 30.0, "the longest a request may sit out ticks waiting for its grammar's "
            "share of the engine (limits.constraint_share) before one step; past it (or past its deadline) the "
            "request fails as above", lo=0, hi=3600, lo_open=True),
    _limits("max_stop_strings", I, MAX_STOP_STRINGS, "stop strings in one request", lo=0, hi=MAX_STOP_STRINGS),
    _limits("max_stop_chars", I, 256, "longest stop string, in characters", lo=1, hi=4096),
    _limits("anonymous_rpcs", I, 8, "health calls without a valid token served at once (Watch streams "
            "included), on threads of their own; beyond: RESOURCE_EXHAUSTED", lo=1, hi=1024),
    _limits("caller_concurrent", I, 0, "requests one caller (token name, certificate subject, or anonymous) may "
            "have running in engine slots at once (an embedding counts while it runs); its further requests wait "
            "in the queue, while other callers' go past them (0 = no cap)", lo=0, hi=1 << 20),
    _limits("caller_queued", I, 0, "requests one caller may have waiting for a slot beyond its running ones; "
            "beyond: 429 / RESOURCE_EXHAUSTED with Retry-After / grpc-retry-pushback-ms (0 = no cap: "
            "server.queue_size bounds every caller's together)", lo=0, hi=1 << 20),
    _limits("caller_tokens_per_minute", I, 0, "prompt + completion tokens one caller may use in any 60 s, "
            "charged as each request ends (a dropped stream too), its requests in flight holding prompt + "
            "max_tokens meanwhile; beyond: refused until the window has room (0 = no cap)", lo=0, hi=1 << 40),
    _limits("callers", L, [], "per-caller overrides, \"IDENTITY=CONCURRENT/QUEUED/TOKENS_PER_MINUTE\" or "
            "\"IDENTITY=CONCURRENT/TOKENS_PER_MINUTE\" (queued: caller_queued) (e.g. \"token:batch=2/4/20000\", "
            "\"anonymous=1/5000\"; 0 = no cap); the identities named here are the "
            "per-caller metrics' labels, every other caller is counted as `other`", check=_caller_limits),
    _auth("tokens_file", S, "", "sha256 hex hashes of bearer tokens, one per line, optionally named: name:hash "
          "(`edgespec config hash-token --name N`)", check=_file_or_empty),
    _auth("admin_tokens_file", S, "", "hashes of tokens that may also call the Admin service",
          check=_file_or_empty),
    _auth("metrics_tokens_file", S, "", "hashes of scrape tokens: they may read /metrics (without the "
          "per-caller figures, which need an admin token) and nothing else; user tokens may not scrape",
          check=_file_or_empty),
    _auth("admin_subjects", L, [], "client certificates that may also call the Admin service (mutual TLS): a "
          "full subject as RFC 4514 writes it (\"CN=ops,O=site\", matched exactly) or \"CN:<common name>\"",
          check=_subjects),
    _tls("cert", S, "", "server certificate chain (PEM); empty = plaintext", check=_file_or_empty),
    _tls("key", S, "", "server private key (PEM)", check=_file_or_empty),
    _tls("client_ca", S, "", "CA bundle (PEM) for client certificates; set = mutual TLS required, and a "
         "verified certificate is an identity", check=_file_or_empty),
    Setting("http", "enabled", B, False, "serve the OpenAI-compatible HTTP API (same tokens, TLS files and "
            "engine as gRPC)"),
    Setting("http", "host", S, "127.0.0.1", "HTTP API address (a non-loopback one needs auth tokens or "
            "server.insecure)", check=check_host),
    Setting("http", "port", I, 8080, "HTTP API port (0 = pick a free one)", lo=0, hi=65535),
    Setting("http", "header_timeout_seconds", F, 10.0, "a connection must send a request's headers within this "
            "long of opening, or of its last request's end; else it is closed (idle and slow-header sockets)",
            lo=0.5, hi=3600),
    Setting("http", "max_connections", I, 1024, "open HTTP connections at most: one more closes the oldest "
            "connection with no request in flight, so idle sockets never lock a client out (requests in flight "
            "are capped apart, at server.parallel + server.queue_size + 32)", lo=16, hi=1 << 20),
    Setting("http", "strict", B, False, "refuse a request field the API (OpenAI's or Anthropic's) does not define, "
            "and a model this server does not serve, naming them (false: ignore the field, answer with the served "
            "model, and name both in the x-edgespec-warning response header)"),
    Setting("metrics", "enabled", B, False, "serve Prometheus text metrics over HTTP"),
    Setting("metrics", "host", S, "127.0.0.1", "metrics address (loopback by default)", check=check_host),
    Setting("metrics", "port", I, 9464, "metrics port", lo=0, hi=65535),
    Setting("logging", "level", S, "info", "log level", choices=("debug", "info", "warning", "error")),
    Setting("logging", "json", (str, bool), "auto", "auto: JSON under systemd / without a TTY, console otherwise",
            check=_json_mode),
    Setting("logging", "log_text", B, False, "log prompt and output text (off by default)"),
    Setting("audit", "shadow_fraction", F, 0.0, "fraction of finished greedy speculative requests re-decoded "
            "in plain mode when the engine is idle; a differing output is counted (Stats, /metrics) and logged "
            "with its request id (0 = off)", lo=0.0, hi=1.0),
    Setting("audit", "shadow_queue", I, 16, "requests waiting for their shadow decode; beyond, the oldest "
            "is skipped", lo=1, hi=4096),
    Setting("models", "memory_bytes", I, 0, "the memory every chat model ([target] and each [[chat]] entry) with "
            "its KV cache and compute buffers, and the [embedding] and [rerank] contexts, may take together; a model "
            "that would not fit beside the loaded ones waits for an idle one to be unloaded (its keep_alive passed); "
            "0 = the device's memory (RAM, or the GPU's when layers are offloaded) less the plan's headroom",
            lo=0, hi=1 << 50, hi_text="2^50"),
    Setting("models", "keep_alive", F, 300.0, "seconds a chat model stays loaded after its last request: then an "
            "on_demand model is unloaded, and a model loaded at start (the default model) may be unloaded to make "
            "room for another ([[chat]] keep_alive overrides it; -1 = never unloaded; the default model stays "
            "loaded while [embedding] or [rerank] runs on its weights)",
            lo=-1, hi=1e9),
    Setting("models", "load_wait_seconds", F, 600.0, "the longest a request without a deadline of its own "
            "waits for its model to load (and for the memory to load it); a request's own deadline "
            "(gRPC deadline, edgespec.timeout_seconds) bounds the wait too", lo=1, hi=86400),
    # the adaptive controller (docs/controller.md): acceptance model
    _ctl("window", I, 32, "speculative steps of this request the acceptance estimate looks at", lo=1, hi=4096),
    _ctl("decay", F, 1.0, "weight of a step in the window = decay**age (1 = plain sliding window)", lo=0.5, hi=1.0),
    _ctl("drift_threshold", F, 4.0, "CUSUM alarm level for a sudden acceptance drop (0 = off)", lo=0.0, hi=100.0),
    _ctl("drift_drop", F, 0.5, "the drop the detector looks for: acceptance falling to this fraction",
         lo=0.01, hi=0.99),
    _ctl("prior_weight", F, 1.0, "pseudo-count (in trials) of the cross-request prior in each estimate",
         lo=0.0, hi=1000.0),
    _ctl("prior_alpha", F, 0.2, "how fast the cross-request prior follows finished requests (EWMA)", lo=0.0, hi=1.0),
    # circuit breaker
    _ctl("open_margin", F, 0.1, "open the breaker when the best expected speedup < 1 - open_margin ...",
         lo=0.0, hi=0.9),
    _ctl("open_after_steps", I, 2, "... for this many consecutive steps", lo=1, hi=1000),
    _ctl("close_margin", F, 0.05, "close when the probes' expected speedup > 1 + close_margin", lo=0.0, hi=10.0),
    _ctl("min_dwell_steps", I, 4, "speculative steps the breaker stays closed before it may open again",
         lo=0, hi=100000),
    _ctl("cooldown_tokens", I, 32, "tokens decoded plainly (zero drafting) before the first probe", lo=1, hi=1 << 20),
    _ctl("max_cooldown_tokens", I, 512, "cap of the cooldown after repeated failed probes", lo=1, hi=1 << 20),
    _ctl("cooldown_growth", F, 2.0, "cooldown multiplier after each failed probe", lo=1.0, hi=100.0),
    _ctl("probe_steps", I, 3, "speculative steps of a half-open probe", lo=1, hi=1000),
    _ctl("probe_depth", I, 2, "the probe is a chain of this depth", lo=1, hi=CONTROLLER_MAX_DEPTH),
    _ctl("probe_cost_fraction", F, 0.05, "skip a probe whose draft catch-up would cost more than this fraction of "
         "the request's remaining plain decoding (short requests after a long plain phase)", lo=0.0, hi=1.0),
    # shapes
    _ctl("min_depth", I, 1, "shallowest draft the controller picks", lo=1, hi=CONTROLLER_MAX_DEPTH),
    _ctl("max_depth", I, 8, "deepest draft the controller picks", lo=1, hi=CONTROLLER_MAX_DEPTH),
    _ctl("max_nodes", I, 64, "most verification nodes of a shape", lo=1, hi=CONTROLLER_MAX_NODES),
    _ctl("max_width", I, 4, "most children per expanded node", lo=1, hi=CONTROLLER_MAX_WIDTH),
    _ctl("stop_prob", F, 0.6, "stop drafting when the best path's estimated acceptance falls below this "
         "(measured, fixed chain of 4: 0.82x -> 1.0x plain at 0.5-0.85 when drafting is dear)", lo=0.0, hi=1.0),
    _ctl("calibrate_stop", B, True, "the path estimate stop_prob is compared with: the product of calibrated "
         "acceptance (P(accepted | draft probability), learnt from this request and across requests) if true, "
         "the draft's own cumulative probability if false"),
    _ctl("first_token_plain", B, True, "the request's first step decodes plainly: its first token comes after "
         "one target forward, and the draft absorbs the prompt in the second step"),
    _ctl("enable_chain", B, True, "let the controller pick chains"),
    _ctl("enable_tree", B, True, "let the controller pick EAGLE-2 style expanded trees"),
    _ctl("enable_runner_ups", B, True, "let the controller pick a chain + the draft's runner-up tokens as leaves"),
    _ctl("enable_ngram", B, True, "model-free prompt-lookup drafts (the only drafter without a draft model)"),
    # cost model
    _ctl("ewma_alpha", F, 0.1, "weight of one online timing in the cost model", lo=0.0, hi=1.0),
)

SECTION_HELP = {
    "server": "The gRPC listener, the engine's slots and queue, and what a request may ask for.",
    "target": "The target model: the distribution every mode reproduces exactly.",
    "draft": "The draft model that proposes tokens (its logits never change the output, only the speed).",
    "embedding": "Embeddings (/v1/embeddings, Inference.Embed): the target's weights, or a model of their own.",
    "rerank": "Reranking (/v1/rerank, Inference.Rerank): a GGUF cross-encoder, or a causal LM scored by its "
              "yes/no logits (the target's weights, or a model of their own).",
    "speculation": "The speculation policy and the shape defaults a request gets when it sets none. "
                   "SIGHUP reloads it; `edgespec policy` (Admin.SetPolicy) overrides stay on top until reset.",
    "limits": "What one request may send, checked by the gRPC and HTTP handlers before the engine sees it.",
    "auth": "Bearer tokens and admin identities. SIGHUP re-reads the files.",
    "tls": "TLS and mutual TLS for gRPC and HTTP. SIGHUP re-reads the files (turning TLS on or off needs "
           "a restart).",
    "http": "The OpenAI-compatible HTTP API.",
    "metrics": "Prometheus text metrics.",
    "logging": "Structured logs.",
    "audit": "Exactness an operator can audit: shadow plain decodes of live greedy requests, run when the engine "
             "is idle (docs/architecture.md, \"Exactness\").",
    "models": "Several chat models in one daemon: the memory they share, how long an idle one stays loaded, "
              "how long a request waits for a load. The models themselves: [target] (the default) and [[chat]].",
    "controller": "The adaptive controller of `auto` mode and its circuit breaker (docs/controller.md).",
}

SECTIONS: dict[str, dict[str, Setting]] = {}
for _s in SETTINGS:
    SECTIONS.setdefault(_s.section, {})[_s.key] = _s
del _s


def setting(section: str, key: str) -> Setting:
    return SECTIONS[section][key]


def defaults(section: str) -> dict[str, Any]:
    """{key: default} of a section (lists copied)."""
    return {k: (list(s.default) if isinstance(s.default, list) else s.default) for k, s in SECTIONS[section].items()}


def section_class(name: str, section: str, doc: str, module: str, *,
                  namespace: Mapping[str, Any] | None = None, tuples: Iterable[str] = ()) -> type:
    """A frozen dataclass with one field per key of `section`, defaulting to the declaration
    (list keys named in `tuples` become tuples)."""
    keys = {key: (section, key) for key in SECTIONS[section]}
    return settings_class(name, keys, doc, module, namespace=namespace, tuples=tuples)


def settings_class(name: str, keys: Mapping[str, tuple[str, str]], doc: str, module: str, *,
                   namespace: Mapping[str, Any] | None = None, tuples: Iterable[str] = ()) -> type:
    """A frozen dataclass with a field per `keys` item (field name -> the (section, key) declaring
    its type and default)."""
    tuples = set(tuples)
    fields = []
    for attr, (section, key) in keys.items():
        s = SECTIONS[section][key]
        default = tuple(s.default) if attr in tuples else s.default
        typ = tuple[str, ...] if attr in tuples else (float if s.types == F else s.types[0])
        fields.append((attr, typ, dataclasses.field(default=default)))
    cls = dataclasses.make_dataclass(name, fields, frozen=True, namespace=dict(namespace or {}))
    cls.__doc__, cls.__module__ = doc, module
    return cls


# ---- request fields: checked in one place for gRPC, HTTP and the CLI --------------------------

_req = partial(Setting, "sampling")
SAMPLING: dict[str, Setting] = {s.key: s for s in (
    _req("temperature", F, 0.0, "0 = greedy", lo=0, hi=100),
    _req("top_k", I, 0, "0 = off", lo=0),
    _req("top_p", F, 1.0, "nucleus mass kept", lo=0, hi=1, lo_open=True),
    _req("min_p", F, 0.0, "keep tokens at least min_p times the top one's probability", lo=0, hi=1, hi_open=True),
    _req("seed", I, None, "sampling seed", lo=0, hi=2**63, hi_open=True, hi_text="2^63"),
    _req("max_tokens", I, 128, "tokens to generate at most", lo=1, hi=1 << 20),
    _req("presence_penalty", F, 0.0, "subtracted from the logit of every token the output already holds",
         lo=-2, hi=2),
    _req("frequency_penalty", F, 0.0, "subtracted from a token's logit once per time the output holds it",
         lo=-2, hi=2),
    _req("repetition_penalty", F, 1.0, "divides the positive logit (multiplies the negative one) of every token "
         "the prompt or output holds; 1 = off", lo=0, lo_open=True, hi=10),
    _req("ignore_eos", B, False, "end-of-generation tokens are never sampled (as llama.cpp's ignore_eos): "
         "the request runs to max_tokens, a stop string or its deadline"),
)}
MAX_LOGIT_BIAS = 1024  # logit_bias entries a request may set
LOGIT_BIAS_RANGE = 100.0  # each in [-100, 100], as OpenAI's
SPECULATION: dict[str, Setting] = {k: SECTIONS["speculation"][k] for k in ("draft_tokens", "tree_nodes", "tree_depth")}


def check_fields(values: Mapping[str, Any], fields: Mapping[str, Setting], *, prefix: str = "",
                 caps: Mapping[str, int] | None = None) -> None:
    """Raise BadRequest naming the first field of `values` (prefix + key) outside its declared
    range; `caps` lowers a field's upper bound (the server's max_tokens, max_draft_tokens...).
    None means unset and is left alone."""
    for key, value in values.items():
        s = fields[key]
        if value is None:
            continue
        if caps and key in caps:
            s = dataclasses.replace(s, hi=min(caps[key], s.hi) if s.hi is not None else caps[key], hi_text="")
        msg = s.problem(value)
        if msg:
            raise BadRequest(prefix + key, msg)


def check_stop(stop: Iterable[Any], *, prefix: str = "", max_strings: int = MAX_STOP_STRINGS,
               max_chars: int | None = None) -> tuple[str, ...]:
    """Stop strings: at most `max_strings`, each a non-empty string of at most `max_chars`
    characters (the [limits] keys are named when they are the bound)."""
    stop = tuple(stop)
    where = " (limits.max_stop_strings)" if max_chars is not None else ""
    if len(stop) > max_strings:
        raise BadRequest(prefix + "stop", f"at most {max_strings} stop strings{where}, got {len(stop)}")
    for i, st in enumerate(stop):
        if not isinstance(st, str) or not st:
            raise BadRequest(f"{prefix}stop[{i}]", "must be a non-empty string")
        if max_chars is not None and len(st) > max_chars:
            raise BadRequest(f"{prefix}stop[{i}]", f"at most {max_chars} characters (limits.max_stop_chars), "
                                                    f"got {len(st)}")
    return stop
