"""Beam RunInference for the gpt-oss engine: a ModelHandler, per-document seeded sampling, prompts.

    handler = GptOssModelHandler(EngineSettings("ckpt/"), GenerationParams(max_tokens=256))
    keyed = KeyedGptOssModelHandler(handler)
    (doc_id, {"tokens": [...], "seed": 7}) | RunInference(keyed) -> (doc_id, PredictionResult)

Examples (what ``run_inference`` accepts): a token list, ``{"tokens": [...]}``,
``{"messages": [{"role": ..., "content": ...}, ...]}`` (a harmony conversation, rendered
here), each dict optionally with ``"seed"`` (the document's sampling seed, see
:func:`doc_seed`). Inference: a dict ``{tokens, text, final, finish_reason, prompt_tokens,
generated_tokens}``.

The engine (:class:`GptOssEngine`) runs one continuous batch per ``run_inference`` call
(``BatchedGenerator``'s add/step/update) and draws each sequence's tokens from its own
``torch.Generator`` seeded with the document's seed, so a document's output does not depend
on which other documents share its batch.

The ModelHandler itself, :class:`~refinery.transforms.inference.model_handler.GptOssModelHandler`,
is in :mod:`.model_handler`: importing this module imports neither torch nor Beam's ML
package (which imports torch), so a driver can read settings without them.
"""
from __future__ import annotations

import hashlib
import os
import secrets
import stat
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence, TypedDict

from refinery.transforms.formats.harmony import parse_final, render_prompt
from refinery.transforms.formats.tiktoken_vocab import get_encoding
from refinery.transforms.io.beam_private import secure_shared_models, shared_models_setting

if TYPE_CHECKING:  # the engine's modules import torch: its methods import them when they run
    import torch

    from refinery.kernels.batching import BatchedGenerator
    from refinery.kernels.model import Transformer

METRICS_NAMESPACE = "refinery_inference"


@dataclass(frozen=True)
class EngineSettings:
    """How to build the engine: checkpoint folder, device, compute dtype and batching limits."""

    checkpoint: str
    device: str = "cpu"
    dtype: str = "bfloat16"  # float32 | bfloat16 | float16 | float64
    max_batch: int = 16  # sequences decoded together (continuous batching)
    max_seq_len: int = 4096  # prompt + generated tokens per sequence
    block_size: int = 16
    prefill_chunk: int = 512

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class GenerationParams:
    max_tokens: int = 256
    temperature: float = 0.0
    seed: int = 0  # global seed; each document's seed is doc_seed(seed, doc_id)
    stop_tokens: tuple[int, ...] = (200002, 200012)  # harmony <|return|>, <|call|>
    # constrained decoding: generated token i must be one of choices[i] (while i < len(choices));
    # empty = unconstrained. See refinery.transforms.hydra.oracle.json_answer_choices.
    choices: tuple[tuple[int, ...], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        d = {**asdict(self), "stop_tokens": list(self.stop_tokens)}
        if self.choices:
            d["choices"] = [list(c) for c in self.choices]
        else:
            del d["choices"]  # an unconstrained run's settings read as they did before the option
        return d


def doc_seed(global_seed: int, doc_id: str) -> int:
    """A document's sampling seed: 63 bits of sha256(global seed, doc id)."""
    digest = hashlib.sha256(f"{int(global_seed)}\x00{doc_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def prompt_tokens(example: Any) -> list[int]:
    """The prompt tokens of an example: a token list, ``{"tokens"}`` or ``{"messages"}``."""
    if isinstance(example, Mapping):
        if "tokens" in example:
            return [int(t) for t in example["tokens"]]
        if "messages" in example:
            return render_prompt(list(example["messages"]))
        raise ValueError(f"example has neither 'tokens' nor 'messages': keys {sorted(example)}")
    if isinstance(example, (list, tuple)):
        return [int(t) for t in example]
    raise TypeError(f"example must be a token list or a dict, got {type(example).__name__}")


def example_seed(example: Any, default: int) -> int:
    return int(example.get("seed", default)) if isinstance(example, Mapping) else int(default)


def example_length(element: Any) -> int:
    """Prompt length of an example or of a keyed ``(key, example)`` element (for batching)."""
    if isinstance(element, tuple) and len(element) == 2 and isinstance(element[1], (Mapping, list)):
        element = element[1]
    if isinstance(element, Mapping):
        if "tokens" in element:
            return len(element["tokens"])
        return sum(len(str(m.get("content", ""))) // 4 + 4 for m in element.get("messages", []))
    return len(element)


def decode(tokens: Sequence[int]) -> str:
    """o200k_harmony text of tokens (special tokens spelled out)."""
    return get_encoding().decode([int(t) for t in tokens])


# ---------------------------------------------------------------------------------------
# Sampling (torch, imported lazily)
# ---------------------------------------------------------------------------------------

def sample_rows(logits: torch.Tensor, temperature: float, generators: Sequence[torch.Generator]) -> list[int]:
    """One token per row of ``logits [B, V]``: greedy for ``temperature <= 0``, else an
    inverse-CDF draw with row ``b``'s own ``generators[b]`` (one uniform per token), so a
    sequence's draws depend only on its own seed and its own logits. Computed where the
    logits are (:func:`refinery.kernels.sampling.sample_rows`: only the uniforms cross)."""
    from refinery.kernels.sampling import sample_rows as on_logits_device  # lazy: torch

    return on_logits_device(logits, temperature, generators)


_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
           "float16": "float16", "fp16": "float16", "float64": "float64"}


class GptOssEngine:
    """A loaded gpt-oss model plus a continuous-batching generator. One per worker (or
    shared across processes through Beam); every public method takes and returns plain,
    picklable Python values (the handler may call it through a cross-process proxy)."""

    def __init__(self, settings: EngineSettings) -> None:
        import torch  # lazy: torch (this module is read without it)

        from refinery.kernels.model import Transformer  # lazy: torch

        if settings.dtype not in _DTYPES:
            raise ValueError(f"unknown dtype {settings.dtype!r} (use one of {sorted(_DTYPES)})")
        self.settings = settings
        dtype = getattr(torch, _DTYPES[settings.dtype])
        t0 = time.perf_counter()
        self.model: Transformer = Transformer.from_checkpoint(settings.checkpoint, device=settings.device, dtype=dtype)
        self.load_seconds = time.perf_counter() - t0
        self._reset()
        self._lock = threading.Lock()  # one batch at a time (threads of a shared model)

    def info(self) -> dict[str, Any]:
        c = self.model.config
        return {"num_hidden_layers": c.num_hidden_layers, "hidden_size": c.hidden_size,
                "vocab_size": c.vocab_size, "load_seconds": self.load_seconds, **self.settings.to_dict()}

    def generate(self, prompts: Sequence[Sequence[int]], seeds: Sequence[int], max_tokens: int,
                 temperature: float = 0.0, stop_tokens: Iterable[int] = (),
                 choices: Sequence[Sequence[int]] = ()) -> list[EngineOutput]:
        """Generate for every prompt in one continuous batch; results in prompt order:
        ``{tokens, finish_reason: stop|length|context}`` (a stop token is kept as the last token).
        ``choices``: constrained decoding, generated token ``i`` is drawn among ``choices[i]``
        only (for ``i < len(choices)``; the model's logits still pick within each set)."""
        stops = {int(t) for t in stop_tokens}
        limit = self.settings.max_seq_len
        with self._lock:
            if not self.generator.idle:
                raise RuntimeError("engine generator is busy")
            token_lists = [[int(t) for t in p] for p in prompts]
            for i, prompt in enumerate(token_lists):
                if not 0 < len(prompt) < limit:
                    raise ValueError(f"prompt {i} has {len(prompt)} tokens; it must have 1 to {limit - 1} "
                                     f"(max_seq_len {limit})")
            try:
                return self._generate(token_lists, seeds, max_tokens, temperature, stops,
                                      [tuple(int(t) for t in c) for c in choices])
            except BaseException:
                self._reset()  # a half-run batch must not leak into the next one
                raise

    def _reset(self) -> None:
        from refinery.kernels.batching import BatchedGenerator  # lazy: torch

        s = self.settings
        self.generator: BatchedGenerator = BatchedGenerator(
            self.model, max_seq_len=s.max_seq_len, max_batch=s.max_batch, block_size=s.block_size,
            prefill_chunk=s.prefill_chunk)

    def _generate(self, prompts: list[list[int]], seeds: Sequence[int], max_tokens: int, temperature: float,
                  stops: set[int], choices: list[tuple[int, ...]]) -> list[EngineOutput]:
        import torch  # lazy: torch

        from refinery.kernels.sampling import constrain_logits  # lazy: torch

        gen, limit = self.generator, self.settings.max_seq_len
        ids: list[int] = []
        budgets: dict[int, int] = {}
        rngs: dict[int, torch.Generator] = {}
        for prompt, seed in zip(prompts, seeds):
            sid = gen.add(prompt, max_tokens)
            ids.append(sid)
            budgets[sid] = min(max_tokens, limit - len(prompt))
            rngs[sid] = torch.Generator(device="cpu").manual_seed(int(seed))
        out: dict[int, list[int]] = {i: [] for i in ids}
        reason: dict[int, str] = {}
        while not gen.idle:
            step = gen.step()
            if step is None:
                break
            logits, seq_ids = step
            if choices:
                logits = constrain_logits(logits, [choices[len(out[s])] if len(out[s]) < len(choices) else None
                                                   for s in seq_ids])
            chosen = sample_rows(logits, temperature, [rngs[s] for s in seq_ids])
            for sid, token in zip(seq_ids, chosen):
                out[sid].append(token)
                if token in stops:
                    reason[sid] = "stop"
                elif len(out[sid]) >= max_tokens:
                    reason[sid] = "length"
                elif len(out[sid]) >= budgets[sid]:
                    reason[sid] = "context"
                gen.update(sid, token, finished=sid in reason)
        return [EngineOutput(tokens=out[i], finish_reason=reason.get(i, "length")) for i in ids]

    def hidden_states(self, prompts: Sequence[Sequence[int]], layers: Sequence[int],
                      max_tokens: int | None = None) -> list[dict[int, Any]]:
        """Per prompt, ``{layer: float32 numpy [T, hidden]}`` (residual stream after ``layer``
        blocks; prompts cut to their first ``max_tokens``)."""
        import torch  # lazy: torch

        validate_layers(layers, self.model.config.num_hidden_layers)
        out = []
        with self._lock:
            for prompt in prompts:
                tokens = torch.tensor([int(t) for t in prompt][: max_tokens or None], dtype=torch.long)
                hidden = self.model(tokens, return_hidden=list(layers))
                out.append({int(k): v.float().cpu().numpy() for k, v in hidden.items()})
        return out


def validate_layers(layers: Iterable[int], num_layers: int) -> None:
    """Layer indices run from 1 to ``num_layers`` (the residual stream after that block)."""
    for layer in layers:
        if not 1 <= int(layer) <= num_layers:
            raise ValueError(f"layer {layer} is not valid for a model with {num_layers} layers "
                             f"(use 1..{num_layers})")


_ENGINES: dict[EngineSettings, GptOssEngine] = {}
_ENGINES_LOCK = threading.Lock()


def cached_engine(settings: EngineSettings) -> GptOssEngine:
    """One engine per settings per process (for work that runs outside RunInference)."""
    with _ENGINES_LOCK:
        engine = _ENGINES.get(settings)
        if engine is None:
            engine = _ENGINES[settings] = GptOssEngine(settings)
        return engine


class EngineOutput(TypedDict):
    """What :meth:`GptOssEngine.generate` made of one prompt."""

    tokens: list[int]  # generated token ids, the stop token kept last when one ended it
    finish_reason: str  # "stop", "length" or "context"


class Generation(TypedDict):
    """What the engine made of one example (a ``PredictionResult``'s ``inference``)."""

    tokens: list[int]  # generated token ids, the stop token included when one ended it
    text: str  # the tokens decoded (without the stop token)
    final: str | None  # the harmony final channel's text, when the output has one
    finish_reason: str  # "stop" or "length"
    prompt_tokens: int
    generated_tokens: int


def run_generation(engine: GptOssEngine, batch: Sequence[Any], params: GenerationParams) -> list[Generation]:
    """The generations of a batch of examples (the body of the handler's ``run_inference``)."""
    prompts = [prompt_tokens(e) for e in batch]
    seeds = [example_seed(e, params.seed) for e in batch]
    constrained = {"choices": [list(c) for c in params.choices]} if params.choices else {}
    results = engine.generate(prompts, seeds, params.max_tokens, params.temperature, list(params.stop_tokens),
                              **constrained)
    out: list[Generation] = []
    for prompt, res in zip(prompts, results):
        tokens = list(res["tokens"])
        body = tokens[:-1] if tokens and tokens[-1] in params.stop_tokens else tokens
        out.append({"tokens": tokens, "text": decode(body), "final": parse_final(tokens),
                    "finish_reason": res["finish_reason"], "prompt_tokens": len(prompt),
                    "generated_tokens": len(tokens)})
    return out


@dataclass
class BatchingOptions:
    """How RunInference batches: by prompt length. ``element_size_fn`` is an example's prompt
    tokens; a batch holds between ``max_seq_len`` (so that any one prompt fits: BatchElements
    would emit an empty batch for an element heavier than its target) and ``batch_tokens``
    prompt tokens, Beam's estimator choosing the size in between. Elements arrive sorted by
    length within a unit, so a batch holds prompts of similar length."""

    max_seq_len: int = 4096
    batch_tokens: int = 8192
    extra: dict[str, Any] = field(default_factory=dict)

    def kwargs(self) -> dict[str, Any]:
        low = max(1, self.max_seq_len)
        return {"min_batch_size": low, "max_batch_size": max(low, self.batch_tokens),
                "element_size_fn": example_length, **self.extra}


# ---------------------------------------------------------------------------------------
# Sharing one engine between worker processes, privately
# ---------------------------------------------------------------------------------------

_SHARING_SECRET: list[bytes] = []


def sharing_secret() -> bytes:
    """This driver's key for the models its workers share: 32 random bytes, made once per
    process (every wave of a run, and an in-process runner reusing a loaded model across
    waves, must agree on it)."""
    if not _SHARING_SECRET:
        _SHARING_SECRET.append(secrets.token_bytes(32))
    return _SHARING_SECRET[0]


def sharing_folder_path(secret: bytes) -> str:
    """Where :func:`sharing_folder` is: ``$TMPDIR/refinery-mps-UID-HASH`` (not made here)."""
    return os.path.join(tempfile.gettempdir(), f"refinery-mps-{os.getuid()}-{hashlib.sha256(secret).hexdigest()[:16]}")


def sharing_folder(secret: bytes) -> str:
    """The private folder of one run's shared-model server: ``$TMPDIR/refinery-mps-UID-HASH``,
    mode 0700, owned by this user (refused otherwise: another user made it)."""
    folder = sharing_folder_path(secret)
    os.makedirs(folder, mode=0o700, exist_ok=True)
    st = os.lstat(folder)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) != 0o700:
        raise RuntimeError(f"{folder}: not a private folder of this user (mode {oct(st.st_mode)}, uid "
                           f"{st.st_uid}); refusing to share the model through it")
    return folder


def secure_model_sharing(secret: bytes) -> str:
    """Make Beam's shared-model server (``apache_beam.utils.multi_process_shared``, used by
    RunInference when a model is shared across processes) private to this run, in this
    process: its authentication key becomes ``secret`` (Beam's default is the fixed
    ``b"mps"``, so any local user could connect and have a pickle unpickled in the server)
    and its address and lock files go to :func:`sharing_folder` instead of ``/tmp`` under a
    predictable name. Every worker process of the run calls it with the same secret (it
    travels inside the pickled handler), before RunInference starts or reaches the server
    (the handler's ``set_environment_vars``); calling it again changes nothing. Returns the
    folder."""
    folder = sharing_folder(secret)
    secure_shared_models(secret, folder)
    return folder


def sharing_is_secured(secret: bytes) -> bool:
    """Whether this process's shared-model server is the one :func:`secure_model_sharing` made
    private with ``secret`` (its key, and a folder named after it)."""
    return shared_models_setting() == (secret, sharing_folder_path(secret))
