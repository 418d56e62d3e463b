"""HYDRA pieces without Beam: oracle output parsing, calibration, head training, doc ids."""
from __future__ import annotations

import json

import numpy as np
import pytest

from refinery.transforms.formats.docids import parse_doc_id
from refinery.transforms.hydra.calibrate import calibrate, decide, fit_weights, threshold_for_rate
from refinery.transforms.hydra.oracle import DIMENSIONS, json_answer_choices, parse_oracle_tokens, parse_scores
from refinery.transforms.hydra.slices import split_of

GOOD = {"helpfulness": 3, "correctness": 4, "coherence": 2, "complexity": 1, "density": 0}


def _completion(text: str) -> list[int]:
    from refinery.transforms.formats.tiktoken_vocab import get_encoding

    return get_encoding().encode(text, allowed_special="all")


def test_parse_well_formed_harmony_output() -> None:
    tokens = _completion("<|channel|>analysis<|message|>The text is {a draft}.<|end|><|start|>assistant"
                         f"<|channel|>final<|message|>{json.dumps(GOOD)}<|return|>")
    scores, error, final = parse_oracle_tokens(tokens)
    assert error is None and scores == {k: float(v) for k, v in GOOD.items()}
    assert final is not None and json.loads(final) == GOOD
    # truncated before <|return|>, fenced, with prose around it: still the final channel's JSON
    fenced = _completion(f"<|channel|>final<|message|>Scores:\n```json\n{json.dumps(GOOD)}\n```")
    assert parse_oracle_tokens(fenced)[0] == {k: float(v) for k, v in GOOD.items()}


def test_constrained_json_answer_parses_for_every_digit_choice() -> None:
    """Every completion the constrained decoding allows is a parseable answer with exactly the
    chosen digits; the CLI's help states its length."""
    from refinery.beam_pipelines.hydra import CONSTRAINED_JSON_TOKENS
    from refinery.transforms.formats.harmony import RETURN_TOKEN

    choices = json_answer_choices()
    free = [i for i, c in enumerate(choices) if len(c) > 1]
    assert len(free) == len(DIMENSIONS) and choices[-1] == (RETURN_TOKEN,)
    assert all(len(c) == 1 for i, c in enumerate(choices) if i not in free)
    for pick in range(5):
        tokens = [c[(pick + i) % 5] if len(c) > 1 else c[0] for i, c in enumerate(choices)]
        scores, error, final = parse_oracle_tokens(tokens)
        assert error is None and final is not None and scores is not None and json.loads(final) == scores
        assert [scores[d] for d in DIMENSIONS] == [float((pick + i) % 5) for i in free]
    assert CONSTRAINED_JSON_TOKENS == len(choices)
    # an output's recorded settings: unchanged for unconstrained runs, the choices when constrained
    from refinery.transforms.inference.handler import GenerationParams

    assert "choices" not in GenerationParams().to_dict()
    assert GenerationParams(choices=choices).to_dict()["choices"][-1] == [RETURN_TOKEN]


def test_constrained_decoding_masks_logits_to_the_allowed_tokens() -> None:
    torch = pytest.importorskip("torch")
    from refinery.kernels.sampling import constrain_logits, sample_rows

    logits = torch.tensor([[5.0, 1.0, 2.0, 3.0], [5.0, 1.0, 2.0, 3.0], [0.0, 0.0, 9.0, 0.0]])
    masked = constrain_logits(logits, [(1, 3), None, (0,)])
    assert sample_rows(masked, 0.0, []) == [3, 0, 0]  # best allowed, unconstrained argmax, forced
    assert torch.equal(masked[1], logits[1]) and torch.isinf(masked[0, [0, 2]]).all()
    gens = [torch.Generator().manual_seed(s) for s in range(3)]
    for _ in range(20):  # sampling never leaves the allowed set
        assert sample_rows(masked, 1.0, gens)[0] in (1, 3)
    assert constrain_logits(logits, [None] * 3) is logits
    with pytest.raises(ValueError, match="2 allowed-token sets for 3 rows"):
        constrain_logits(logits, [None, None])


@pytest.mark.parametrize("text, reason", [
    ("<|channel|>analysis<|message|>" + json.dumps(GOOD) + "<|end|>", "no final channel"),  # analysis only
    ("<|channel|>final<|message|>I cannot grade this.<|return|>", "no JSON object"),
    ("<|channel|>final<|message|>{\"helpfulness\": 3, \"correctness\": <|return|>", "no JSON object"),
    ("<|channel|>final<|message|>{\"helpfulness\": 3,}<|return|>", "malformed JSON"),
    ("<|channel|>final<|message|>" + json.dumps({**GOOD, "density": 7}) + "<|return|>", "outside 0..4"),
    ("<|channel|>final<|message|>" + json.dumps({k: v for k, v in GOOD.items() if k != "coherence"}) +
     "<|return|>", "missing score(s): coherence"),
    ("<|channel|>final<|message|>" + json.dumps({**GOOD, "complexity": "high"}) + "<|return|>", "not a number"),
])
def test_parse_malformed_outputs_records_reason(text: str, reason: str) -> None:
    scores, error, _ = parse_oracle_tokens(_completion(text))
    assert scores is None and reason in str(error)


def test_parse_scores_tolerates_refusal_without_channels_and_string_numbers() -> None:
    assert parse_scores(None) == (None, "no final channel in the output")
    s, e = parse_scores('Sure. {"Helpfulness": "2", "correctness": 2.5, "coherence": 0, "complexity": 4, "density": 1}')
    assert e is None and s is not None and s["helpfulness"] == 2.0 and s["correctness"] == 2.5
    # a bare answer with no harmony markup at all (parse_final returns it whole)
    bare = parse_oracle_tokens(_completion(json.dumps(GOOD)))
    assert bare[1] is None


def _synthetic_labels(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    quality = rng.normal(2.0, 1.0, n)
    noise = rng.normal(0, [0.3, 0.3, 0.5, 2.0, 0.4], (n, 5))  # complexity barely tracks quality
    return np.clip(np.rint(quality[:, None] + noise), 0, 4)


@pytest.mark.parametrize("target", [0.5, 0.3, 0.7])
def test_calibration_hits_target_keep_rate(target: float) -> None:
    scores = _synthetic_labels(2000)
    cal = calibrate(scores, target_keep=target, target_drop=0.15)
    w = np.array([cal["weights"][d] for d in DIMENSIONS])
    agg = scores @ w
    keep = float(np.mean(agg >= cal["tau_keep"]))
    drop = float(np.mean(agg < cal["tau_drop"]))
    assert abs(keep - target) < 0.02 and keep == pytest.approx(cal["achieved_keep"])
    assert abs(drop - 0.15) < 0.02 and cal["tau_drop"] <= cal["tau_keep"]
    assert w.sum() == pytest.approx(1.0) and (w >= 0).all()
    assert w[3] < min(w[0], w[1])  # the noisy dimension gets less weight
    # decisions with those thresholds reproduce the rates
    decisions = [decide(a, cal["tau_drop"], cal["tau_keep"]) for a in agg]
    assert decisions.count("keep") / len(agg) == pytest.approx(keep)


def test_calibration_small_sets_and_ties() -> None:
    assert fit_weights(_synthetic_labels(3)) == pytest.approx(np.full(5, 0.2), abs=0.06)  # near uniform
    tau, achieved = threshold_for_rate(np.array([1, 1, 1, 2, 2, 3]), 0.5)
    assert achieved == pytest.approx(0.5) and 1 < tau < 2
    with pytest.raises(ValueError, match="target-keep"):
        calibrate(_synthetic_labels(10), target_keep=1.5)


def test_doc_ids_and_split_rule() -> None:
    a = parse_doc_id("fineweb//shard_0000/x-v1-shard-000000.npy#s=10:e=42")
    assert (a.source, a.relpath, a.start, a.end) == ("fineweb", "shard_0000/x-v1-shard-000000.npy", 10, 42)
    assert a.doc_id == "fineweb//shard_0000/x-v1-shard-000000.npy#s=10:e=42"
    with pytest.raises(ValueError, match="not a doc id"):
        parse_doc_id("shard_0000/x.npy:3")
    ids = [f"s//f.npy#s={i}:e={i + 1}" for i in range(5000)]
    counts = {s: sum(split_of(i) == s for i in ids) for s in ("train", "val", "test")}
    assert 0.77 < counts["train"] / 5000 < 0.83 and 0.08 < counts["val"] / 5000 < 0.12


def test_probe_and_judge_training_reduce_loss() -> None:
    torch = pytest.importorskip("torch")
    from refinery.transforms.hydra.heads import TrainConfig, judge_preprocess, train_judge, train_probe

    g = torch.Generator().manual_seed(0)
    n, h = 160, 32
    feats = torch.randn(n, h, generator=g)
    true_w = torch.randn(h, 5, generator=g) * 0.3
    targets = (feats @ true_w + 2.0).clamp(0, 4)
    head, losses = train_probe(feats, targets, TrainConfig(epochs=12, batch_size=32, lr=5e-2, warmup_steps=5))
    assert np.mean(losses[-5:]) < 0.2 * np.mean(losses[:5])
    # judge: per-document sequences whose mean carries the signal
    seqs = [judge_preprocess(torch.randn(int(t), h, generator=g) + feats[i]) for i, t in
            enumerate(torch.randint(3, 9, (n,), generator=g))]
    targets_j = torch.stack([(s.mean(0) @ true_w + 2.0).clamp(0, 4) for s in seqs])
    jhead, jlosses = train_judge(seqs, targets_j, TrainConfig(epochs=6, batch_size=32, lr=5e-3, warmup_steps=5),
                                 mid_dim=32)
    assert np.mean(jlosses[-4:]) < 0.6 * np.mean(jlosses[:4])
    from refinery.transforms.hydra.heads import pad_states
    x, mask = pad_states(seqs[:4])
    with torch.no_grad():
        a = jhead(x, mask)
        b = torch.stack([jhead(s.unsqueeze(0))[0] for s in seqs[:4]])
    assert torch.allclose(a, b, atol=1e-4)  # padding does not leak into the scores


def test_readme_laptop_chain_names_every_step_with_known_flags() -> None:
    """The README's laptop hydra commands (run as pasted by hand; the chain itself is tested in
    test_hydra_chain) go through every step in order and name only flags the CLI knows."""
    import re
    import shlex
    from pathlib import Path

    from refinery.beam_pipelines.hydra import CONSTRAINED_JSON_TOKENS, build_parser

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme[readme.index("### Try generate and hydra on a laptop"):readme.index("## hydra: quality grading")]
    commands = [shlex.split(line) for block in re.findall(r"```bash\n(.*?)```", section, flags=re.S)
                for line in block.replace("\\\n", " ").splitlines() if line.startswith("refinery hydra ")]
    steps = []
    for argv in commands:
        args, extra = build_parser().parse_known_args(argv[2:])
        assert extra == [], f"unknown flags {extra} in: {' '.join(argv)}"
        steps.append(args.hydra_command)
        if args.hydra_command == "oracle-label":
            assert args.constrained_json and args.max_tokens >= CONSTRAINED_JSON_TOKENS
    assert steps == ["slices", "oracle-label", "oracle-label", "calibrate", "train", "train", "grade"]
