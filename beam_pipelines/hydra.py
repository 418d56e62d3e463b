"""hydra: quality grading of a tokenized corpus (the HYDRA method: an oracle's grades distilled
into small heads), step by step.

A large gpt-oss (the oracle) grades a sample of documents on five 0-4 dimensions; small
heads over a frozen smaller gpt-oss learn those grades; the heads then grade any corpus.

  slices        doc-id slices train/val/test (md5 of the doc id, 80/10/10) of prep shards
  oracle-label  oracle grades (strict JSON on the harmony final channel) -> labels.jsonl
  calibrate     aggregation weights + tau_drop / tau_keep on validation labels
  train         probe (pooled layer L -> linear) or judge (layer L states -> MTP-judge)
  grade         probe triage, judge, calibrated decision drop|band|keep per document

Documents are addressed as ``{source}//{relpath}#s={start}:e={end}`` in prep output
folders (``--data-root``). oracle-label and grade are resumable Beam pipelines (RunInference,
units of documents; rerun the same command to finish an interrupted run).
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from typing import Union

from refinery.beam_pipelines.checks import UsageError, check_output
from refinery.beam_pipelines.command import Pipeline, RunFlags, add_runner_args, run_and_report, usage_error
from refinery.beam_pipelines.generate import (
    EngineFlags,
    InputFlags,
    add_engine_arguments,
    add_input_arguments,
    document_source,
    engine_settings,
    handler_options,
    inference_pipeline,
)
from refinery.runners import pipeline_args
from refinery.transforms.hydra.calibrate import calibrate, read_labels, write_calibration
from refinery.transforms.hydra.oracle import OracleTask
from refinery.transforms.hydra.slices import SlicesStage
from refinery.transforms.inference.handler import GenerationParams
from refinery.transforms.inference.stages import build_stages
from refinery.transforms.io import storage
from refinery.transforms.resumable import JobResult

EPILOG = """\
examples:
  refinery hydra slices --data-root prep_out/ --output slices/
  refinery hydra oracle-label --checkpoint gpt-oss-120b/original --input-docids slices/docids_val.jsonl \\
      --data-root prep_out/ --output labels/val --max-tokens 2048
  refinery hydra calibrate --labels labels/val/labels.jsonl --output calibration/ --target-keep 0.5
  refinery hydra train probe --checkpoint gpt-oss-20b/original --labels labels/train/labels.jsonl \\
      --data-root prep_out/ --output heads/ --layer 18
  refinery hydra train judge ... --layer 24
  refinery hydra grade --checkpoint gpt-oss-20b/original --heads-dir heads/ --calibration calibration/ \\
      --input-docids slices/docids_test.jsonl --data-root prep_out/ --output quality/test
"""

CONSTRAINED_JSON_TOKENS = 38  # len(oracle.json_answer_choices()), without loading the vocabulary for --help


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    sub = parser.add_subparsers(dest="hydra_command", required=True, metavar="STEP")

    s = sub.add_parser("slices", help="doc-id slices train/val/test (80/10/10 by md5) of prep shards",
                       description="Write OUTPUT/docids_{train,val,test}.jsonl for every document of the "
                                   ".npy/.idx shards under --data-root. Idempotent: unchanged shards -> "
                                   "nothing redone.")
    s.add_argument("--data-root", required=True, metavar="DIR", help="prep output folder(s) root")
    s.add_argument("--output", required=True, metavar="DIR")
    s.add_argument("--force", action="store_true", help="rebuild even if the slices are up to date")

    o = sub.add_parser("oracle-label", help="oracle grades -> labels.jsonl, failures.jsonl, summary.json",
                       description="Grade each document with a harmony prompt asking for strict JSON of five "
                                   "0-4 scores; only the final channel is parsed; failures are recorded.")
    add_input_arguments(o, docids_only=True)
    o.add_argument("--output", required=True, metavar="DIR")
    o.add_argument("--max-tokens", type=int, default=2048, help="generated tokens per document (default: 2048)")
    o.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    o.add_argument("--seed", type=int, default=0)
    o.add_argument("--constrained-json", action="store_true",
                   help="constrained decoding: force the answer to the final channel's JSON, the model picking "
                        f"only each 0-4 digit (no reasoning); needs --max-tokens >= {CONSTRAINED_JSON_TOKENS}. "
                        "For a model that cannot write the JSON, e.g. the tiny random one (its labels are noise)")
    add_engine_arguments(o)
    add_runner_args(o)

    c = sub.add_parser("calibrate", help="aggregation weights and tau_drop/tau_keep -> calibration_summary.json")
    c.add_argument("--labels", nargs="+", required=True, metavar="FILE", help="validation labels.jsonl file(s)")
    c.add_argument("--output", required=True, metavar="DIR")
    c.add_argument("--target-keep", type=float, default=0.5, help="fraction kept (aggregate >= tau_keep; default 0.5)")
    c.add_argument("--target-drop", type=float, default=0.2,
                   help="fraction dropped (aggregate < tau_drop; default 0.2)")

    t = sub.add_parser("train", help="train the probe or the judge head over the frozen backbone")
    t.add_argument("head", choices=["probe", "judge"])
    t.add_argument("--labels", nargs="+", required=True, metavar="FILE", help="training labels.jsonl file(s)")
    t.add_argument("--data-root", required=True, metavar="DIR")
    t.add_argument("--output", required=True, metavar="DIR", help="folder for hydra_{probe,judge}.pt")
    t.add_argument("--layer", type=int, default=None,
                   help="backbone layer (1..num_layers; default: 18 for probe, 24 for judge, as for gpt-oss-20b)")
    t.add_argument("--max-ctx", type=int, default=4096, help="tokens per document at most (default: 4096)")
    t.add_argument("--epochs", type=int, default=1)
    t.add_argument("--batch-size", type=int, default=None, help="default: 256 probe, 128 judge")
    t.add_argument("--lr", type=float, default=None, help="default: 1e-3 probe, 5e-4 judge")
    t.add_argument("--warmup-steps", type=int, default=500, help="linear warmup (at most 20%% of the steps)")
    t.add_argument("--mid-dim", type=int, default=256, help="judge width (default: 256)")
    add_engine_arguments(t)

    g = sub.add_parser("grade", help="probe triage + judge + calibrated decision -> quality_scores.jsonl")
    add_input_arguments(g, docids_only=True)
    g.add_argument("--heads-dir", required=True, metavar="DIR", help="folder with hydra_probe.pt and hydra_judge.pt")
    g.add_argument("--calibration", required=True, metavar="PATH", help="calibration folder or its JSON file")
    g.add_argument("--output", required=True, metavar="DIR")
    g.add_argument("--max-ctx", type=int, default=4096, help="tokens per document at most (default: 4096)")
    add_engine_arguments(g)
    add_runner_args(g)


@dataclass(frozen=True)
class SlicesSettings:
    """``refinery hydra slices``'s flags."""

    data_root: str
    output: str
    run: RunFlags


@dataclass(frozen=True)
class OracleSettings:
    """``refinery hydra oracle-label``'s flags."""

    output: str
    inputs: InputFlags
    engine: EngineFlags
    max_tokens: int
    temperature: float
    seed: int
    constrained_json: bool
    run: RunFlags


@dataclass(frozen=True)
class CalibrateSettings:
    """``refinery hydra calibrate``'s flags."""

    labels: tuple[str, ...]
    output: str
    target_keep: float
    target_drop: float


@dataclass(frozen=True)
class TrainSettings:
    """``refinery hydra train``'s flags."""

    head: str
    labels: tuple[str, ...]
    data_root: str
    output: str
    layer: int | None
    max_ctx: int
    epochs: int
    batch_size: int | None
    lr: float | None
    warmup_steps: int
    mid_dim: int
    engine: EngineFlags


@dataclass(frozen=True)
class GradeSettings:
    """``refinery hydra grade``'s flags."""

    output: str
    inputs: InputFlags
    engine: EngineFlags
    heads_dir: str
    calibration: str
    max_ctx: int
    run: RunFlags


HydraSettings = Union[SlicesSettings, OracleSettings, CalibrateSettings, TrainSettings, GradeSettings]


def settings_from_args(args: argparse.Namespace) -> HydraSettings:
    """The settings of the step ``args`` names (parsed by :func:`add_arguments`' parser)."""
    step = args.hydra_command
    if step == "slices":
        return SlicesSettings(args.data_root, args.output, RunFlags.from_args(args))
    if step == "oracle-label":
        return OracleSettings(args.output, InputFlags.from_args(args), EngineFlags.from_args(args), args.max_tokens,
                              args.temperature, args.seed, args.constrained_json, RunFlags.from_args(args))
    if step == "calibrate":
        return CalibrateSettings(tuple(args.labels), args.output, args.target_keep, args.target_drop)
    if step == "train":
        return TrainSettings(args.head, tuple(args.labels), args.data_root, args.output, args.layer, args.max_ctx,
                             args.epochs, args.batch_size, args.lr, args.warmup_steps, args.mid_dim,
                             EngineFlags.from_args(args))
    if step == "grade":
        return GradeSettings(args.output, InputFlags.from_args(args), EngineFlags.from_args(args), args.heads_dir,
                             args.calibration, args.max_ctx, RunFlags.from_args(args))
    raise ValueError(f"unknown hydra step {step!r}")


def _slices(s: SlicesSettings, beam_args: list[str]) -> int:
    """Through the command runner, like every step: failed units exit 1 with the resume command."""
    output = s.output.rstrip("/")
    try:
        stage = SlicesStage(s.data_root)
    except (storage.InputError, ValueError) as e:
        return usage_error(f"refinery hydra slices: {e}")

    def summary(result: JobResult, seconds: float) -> str:
        counts = result.runs[0].check("slices").done_receipt()["stats"]
        state = "built" if result.ran.get("slices") else "up to date"
        return (f"slices {state}: train {counts['train']:,}, val {counts['val']:,}, test {counts['test']:,} "
                f"({len(stage.shards)} shards) -> {output}/docids_{{train,val,test}}.jsonl")

    p = Pipeline("hydra slices", output, [stage], summary=summary)
    return run_and_report(p, s.run, beam_args or pipeline_args("direct", 1))  # one light unit: in this process


def _oracle(s: OracleSettings, beam_args: list[str]) -> int:
    output = s.output.rstrip("/")
    try:
        params = GenerationParams(max_tokens=s.max_tokens, temperature=s.temperature, seed=s.seed)
        task = OracleTask(engine_settings(s.engine), params, handler_options(s.engine), s.constrained_json)
        stages = build_stages(task, document_source(s.inputs), s.inputs.wave_units)
        stages[0].plan()
    except (storage.InputError, ValueError) as e:
        return usage_error(f"refinery hydra oracle-label: {e}")

    def summary(result: JobResult, seconds: float) -> str:
        st = result.runs[-1].check("merge").done_receipt()["stats"]
        return (f"oracle-label: {st['documents']:,} documents, parsed {st['parsed']:,}, failed {st['failed']:,}, "
                f"unreadable {st['unreadable']:,}; parse rate {100 * st['parse_rate']:.1f}%\n"
                f"  labels: {storage.join(output, 'labels.jsonl')}  failures: {storage.join(output, 'failures.jsonl')}")

    return run_and_report(inference_pipeline("hydra oracle-label", output, stages, "", summary), s.run, beam_args)


def _calibrate(s: CalibrateSettings) -> int:
    try:
        _, scores = read_labels(s.labels)
        summary = calibrate(scores, s.target_keep, s.target_drop)
    except (ValueError, FileNotFoundError) as e:
        print(f"refinery hydra calibrate: {e}", file=sys.stderr)
        return 2
    path = write_calibration(s.output.rstrip("/"), summary)
    w = ", ".join(f"{k} {v:.3f}" for k, v in summary["weights"].items())
    print(f"calibrated on {summary['num_labels']:,} labels: weights {w}\n"
          f"  tau_drop {summary['tau_drop']:.3f} (drop {100 * summary['achieved_drop']:.1f}%), "
          f"tau_keep {summary['tau_keep']:.3f} (keep {100 * summary['achieved_keep']:.1f}%, "
          f"target {100 * summary['target_keep']:.0f}%)\n  {path}", file=sys.stderr)
    return 0


def _train(s: TrainSettings) -> int:
    from refinery.transforms.hydra.heads import TrainConfig  # lazy: imports torch (an extra), for this step only
    from refinery.transforms.hydra.train import HeadJob, run_head_job  # lazy: imports torch, as above

    probe = s.head == "probe"
    cfg = TrainConfig(epochs=s.epochs, batch_size=s.batch_size or (256 if probe else 128),
                      lr=s.lr or (1e-3 if probe else 5e-4), warmup_steps=s.warmup_steps)
    layer = s.layer if s.layer is not None else (18 if probe else 24)
    t0 = time.time()
    try:
        job = HeadJob(s.head, list(s.labels), s.data_root, s.output.rstrip("/"), layer, s.max_ctx, s.mid_dim, cfg)
        st = run_head_job(job, engine_settings(s.engine))
    except (ValueError, FileNotFoundError) as e:
        print(f"refinery hydra train {s.head}: {e}", file=sys.stderr)
        return 2
    print(f"trained {s.head} (layer {layer}) on {st['documents']:,} documents in {time.time() - t0:.1f}s: "
          f"loss {st['first_loss']:.4f} -> {st['last_loss']:.4f} over {st['steps']} steps\n"
          f"  {s.output.rstrip('/')}/hydra_{s.head}.pt", file=sys.stderr)
    return 0


def _grade(s: GradeSettings, beam_args: list[str]) -> int:
    from refinery.transforms.hydra.grade import GradeTask  # lazy: imports torch (an extra), for this step only

    output = s.output.rstrip("/")
    try:
        task = GradeTask(engine_settings(s.engine), s.heads_dir, s.calibration, s.max_ctx, handler_options(s.engine))
        stages = build_stages(task, document_source(s.inputs), s.inputs.wave_units)
        stages[0].plan()
    except (storage.InputError, ValueError, FileNotFoundError) as e:
        return usage_error(f"refinery hydra grade: {e}")

    def summary(result: JobResult, seconds: float) -> str:
        st = result.runs[-1].check("merge").done_receipt()["stats"]
        return (f"grade: {st['documents']:,} documents: keep {st['keep']:,}, band {st['band']:,}, "
                f"drop {st['drop']:,}, errors {st['errors']:,} (judged {st['judged']:,})\n"
                f"  {storage.join(output, 'quality_scores.jsonl')}")

    return run_and_report(inference_pipeline("hydra grade", output, stages, "", summary), s.run, beam_args)


def run(args: argparse.Namespace, beam_args: list[str]) -> int:
    """Run one hydra step; returns a process exit code."""
    s = settings_from_args(args)
    step = args.hydra_command
    try:
        dry_run = s.run.dry_run if isinstance(s, (SlicesSettings, OracleSettings, GradeSettings)) else False
        check_output(f"hydra {step}", s.output, dry_run=dry_run)
    except UsageError as e:
        return usage_error(str(e))
    if isinstance(s, SlicesSettings):
        return _slices(s, beam_args)
    if isinstance(s, OracleSettings):
        return _oracle(s, beam_args)
    if isinstance(s, CalibrateSettings):
        return _calibrate(s)
    if isinstance(s, TrainSettings):
        return _train(s)
    return _grade(s, beam_args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="refinery hydra", description=(__doc__ or "").splitlines()[0])
    add_arguments(p)
    return p


def main(argv: list[str], beam_args: list[str] | None = None) -> int:
    """Parse ``argv`` (after ``hydra``) and run; for tests and ``python -m``."""
    args, extra = build_parser().parse_known_args(argv)
    if extra and not hasattr(args, "runner"):
        raise SystemExit(f"refinery hydra: unrecognized arguments: {' '.join(extra)}")
    return run(args, list(beam_args if beam_args is not None else extra))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
