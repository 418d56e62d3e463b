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

HELP = "HYDRA quality grading: slices, oracle-label, calibrate, train probe|judge, grade"

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
    from refinery.beam_pipelines.command import add_runner_args
    from refinery.beam_pipelines.generate import add_engine_arguments, add_input_arguments

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


def _slices(args, beam_args: list[str]) -> int:
    """Through the command runner, like every step: failed units exit 1 with the resume command."""
    from refinery.beam_pipelines.command import Pipeline, run_pipeline, usage_error
    from refinery.runners import pipeline_args
    from refinery.transforms.hydra.slices import SlicesStage
    from refinery.transforms.io import storage

    output = args.output.rstrip("/")
    try:
        stage = SlicesStage(args.data_root)
    except (storage.InputError, ValueError) as e:
        return usage_error(f"refinery hydra slices: {e}")

    def summary(result, seconds: float) -> str:
        counts = result.runs[0].check("slices").receipt["stats"]
        state = "built" if result.ran.get("slices") else "up to date"
        return (f"slices {state}: train {counts['train']:,}, val {counts['val']:,}, test {counts['test']:,} "
                f"({len(stage.shards)} shards) -> {output}/docids_{{train,val,test}}.jsonl")

    p = Pipeline("hydra slices", output, [stage], summary=summary)
    return run_pipeline(p, args, beam_args or pipeline_args("direct", 1))  # one light unit: in this process


def _oracle(args, beam_args) -> int:
    from refinery.beam_pipelines.command import run_pipeline, usage_error
    from refinery.beam_pipelines.generate import document_source, engine_settings, handler_options, inference_pipeline
    from refinery.transforms.hydra.oracle import OracleTask
    from refinery.transforms.inference.handler import GenerationParams
    from refinery.transforms.inference.stages import build_stages
    from refinery.transforms.io import storage

    output = args.output.rstrip("/")
    try:
        params = GenerationParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
        task = OracleTask(engine_settings(args), params, handler_options(args), args.constrained_json)
        stages = build_stages(task, document_source(args), args.wave_units)
        stages[0].plan()
    except (storage.InputError, ValueError) as e:
        return usage_error(f"refinery hydra oracle-label: {e}")

    def summary(result, seconds: float) -> str:
        s = result.runs[-1].check("merge").receipt["stats"]
        return (f"oracle-label: {s['documents']:,} documents, parsed {s['parsed']:,}, failed {s['failed']:,}, "
                f"unreadable {s['unreadable']:,}; parse rate {100 * s['parse_rate']:.1f}%\n"
                f"  labels: {storage.join(output, 'labels.jsonl')}  failures: {storage.join(output, 'failures.jsonl')}")

    return run_pipeline(inference_pipeline("hydra oracle-label", output, stages, "", summary), args, beam_args)


def _calibrate(args) -> int:
    from refinery.transforms.hydra.calibrate import calibrate, read_labels, write_calibration

    try:
        _, scores = read_labels(args.labels)
        summary = calibrate(scores, args.target_keep, args.target_drop)
    except (ValueError, FileNotFoundError) as e:
        print(f"refinery hydra calibrate: {e}", file=sys.stderr)
        return 2
    path = write_calibration(args.output.rstrip("/"), summary)
    w = ", ".join(f"{k} {v:.3f}" for k, v in summary["weights"].items())
    print(f"calibrated on {summary['num_labels']:,} labels: weights {w}\n"
          f"  tau_drop {summary['tau_drop']:.3f} (drop {100 * summary['achieved_drop']:.1f}%), "
          f"tau_keep {summary['tau_keep']:.3f} (keep {100 * summary['achieved_keep']:.1f}%, "
          f"target {100 * summary['target_keep']:.0f}%)\n  {path}", file=sys.stderr)
    return 0


def _train(args) -> int:
    from refinery.beam_pipelines.generate import engine_settings
    from refinery.transforms.hydra.heads import TrainConfig
    from refinery.transforms.hydra.train import HeadJob, run_head_job

    probe = args.head == "probe"
    cfg = TrainConfig(epochs=args.epochs, batch_size=args.batch_size or (256 if probe else 128),
                      lr=args.lr or (1e-3 if probe else 5e-4), warmup_steps=args.warmup_steps)
    layer = args.layer if args.layer is not None else (18 if probe else 24)
    t0 = time.time()
    try:
        job = HeadJob(args.head, list(args.labels), args.data_root, args.output.rstrip("/"), layer, args.max_ctx,
                      args.mid_dim, cfg)
        s = run_head_job(job, engine_settings(args))
    except (ValueError, FileNotFoundError) as e:
        print(f"refinery hydra train {args.head}: {e}", file=sys.stderr)
        return 2
    print(f"trained {args.head} (layer {layer}) on {s['documents']:,} documents in {time.time() - t0:.1f}s: "
          f"loss {s['first_loss']:.4f} -> {s['last_loss']:.4f} over {s['steps']} steps\n"
          f"  {args.output.rstrip('/')}/hydra_{args.head}.pt", file=sys.stderr)
    return 0


def _grade(args, beam_args) -> int:
    from refinery.beam_pipelines.command import run_pipeline, usage_error
    from refinery.beam_pipelines.generate import document_source, engine_settings, handler_options, inference_pipeline
    from refinery.transforms.hydra.grade import GradeTask
    from refinery.transforms.inference.stages import build_stages
    from refinery.transforms.io import storage

    output = args.output.rstrip("/")
    try:
        task = GradeTask(engine_settings(args), args.heads_dir, args.calibration, args.max_ctx, handler_options(args))
        stages = build_stages(task, document_source(args), args.wave_units)
        stages[0].plan()
    except (storage.InputError, ValueError, FileNotFoundError) as e:
        return usage_error(f"refinery hydra grade: {e}")

    def summary(result, seconds: float) -> str:
        s = result.runs[-1].check("merge").receipt["stats"]
        return (f"grade: {s['documents']:,} documents: keep {s['keep']:,}, band {s['band']:,}, drop {s['drop']:,}, "
                f"errors {s['errors']:,} (judged {s['judged']:,})\n  {storage.join(output, 'quality_scores.jsonl')}")

    return run_pipeline(inference_pipeline("hydra grade", output, stages, "", summary), args, beam_args)


def run(args, beam_args: list[str]) -> int:
    from refinery.beam_pipelines.checks import UsageError, check_output
    from refinery.beam_pipelines.command import usage_error

    step = args.hydra_command
    try:
        check_output(f"hydra {step}", args.output, dry_run=getattr(args, "dry_run", False))
    except UsageError as e:
        return usage_error(str(e))
    if step == "slices":
        return _slices(args, beam_args)
    if step == "oracle-label":
        return _oracle(args, beam_args)
    if step == "calibrate":
        return _calibrate(args)
    if step == "train":
        return _train(args)
    if step == "grade":
        return _grade(args, beam_args)
    raise ValueError(f"unknown hydra step {step!r}")


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
