"""A fake engine for the bench's unit tests: deterministic stats per mode, every call recorded."""

from __future__ import annotations

from edgespec.types import GenerationRequest, GenerationResult, SpecStats

# mode -> (tokens per target forward, seconds per target forward)
SHAPES = {"plain": (1, 0.010), "chain": (2, 0.012), "tree": (4, 0.016), "auto": (3, 0.012)}


class FakeEngine:
    def __init__(self) -> None:
        self.calls: list[tuple[tuple[int, ...], str, int]] = []
        self.samplings: list = []  # each call's SamplingParams
        self.constraints: list = []  # each call's ConstraintSpec (or None)
        self.answer = '{"name": "Ann", "age": 3}'  # the text of a constrained answer
        self.closed = False

    def chat_prompt(self, messages: list[tuple[str, str]]) -> str:
        return "".join(f"<|{role}|>{text}" for role, text in messages) + "<|assistant|>"

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        assert parse_special, "chat prompts must be tokenized with parse_special"
        return [ord(c) for c in text]

    def model_info(self) -> dict:
        return {"backend": "cpu"}

    def generate(self, req: GenerationRequest) -> GenerationResult:
        mode = req.speculation.mode
        n = req.sampling.max_tokens
        per_forward, seconds = SHAPES[mode]
        forwards = -(-n // per_forward)
        self.calls.append((req.prompt_tokens, mode, n))
        self.samplings.append(req.sampling)
        self.constraints.append(req.constraint)
        # each forward: 10 ms of target time, the rest drafting; every step accepts all its drafts
        stats = SpecStats(target_forwards=forwards, emitted_tokens=n, seconds=forwards * seconds,
                          target_seconds=forwards * 0.010, draft_seconds=forwards * (seconds - 0.010),
                          draft_forwards=forwards * (per_forward - 1),
                          accepted_per_depth=[forwards] * (per_forward - 1))
        return GenerationResult(text=self.answer if req.constraint else "x" * n, token_ids=[0] * n, finish_reason="length",
                                prompt_tokens=len(req.prompt_tokens), stats=stats)

    def close(self) -> None:
        self.closed = True
