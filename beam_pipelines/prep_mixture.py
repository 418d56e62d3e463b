"""prep-mixture: every source and split of a mixture TOML -> token shards under one data root.

Each source/split is one resumable ``prep`` run (tokenize -> pack -> manifest, the stages of
:mod:`refinery.transforms.prep.stages`) into ``{data_root}/{source_id}/{split}/``::

    {data_root}/{source_id}/{split}/manifest.json
    {data_root}/{source_id}/{split}/shard_NNNN/{source_id}-v1-shard-NNNNNN.npy (+ .idx)

with that run's own receipts under ``.refinery/``: re-running the same command skips what is
done and finishes the rest. Budgets come from the flow (dev 100M, research 1B, ablation 6B
tokens), capped by ``--max-tokens``, split over the sources by weight (see
:mod:`refinery.transforms.loader.mixture`); each source's budget is prep's ``--max-tokens`` for its
train split, and ``--valid-percent`` of it for the other splits.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, replace
from typing import Any, NoReturn

from refinery.beam_pipelines.checks import (
    UsageError,
    add_reject_rate_arg,
    bad_reject_rate,
    check_output,
)
from refinery.beam_pipelines.command import RunFlags, add_runner_args, usage_error
from refinery.beam_pipelines.interrupt import interrupted, resume_hint
from refinery.beam_pipelines.prep import (
    TokenizerFlags,
    add_tokenizer_args,
    resolve_tokenizer_flags,
    settle_prep_output,
)
from refinery.runners.jobs import run_job
from refinery.transforms.formats.tokenizer_choice import DEFAULT, TokenizerSpec
from refinery.transforms.io import storage
from refinery.transforms.io.hf import HfSource, resolve_hf_parquet
from refinery.transforms.loader import mixture as mx
from refinery.transforms.prep.stages import PrepConfig, build_stages, clear_stale_manifest, parse_token_count
from refinery.transforms.resumable import Stage, bind_stages, run_stages

# what the local runner's warm worker process imports ahead (runners.warm_workers)
WORKER_IMPORTS = ("refinery.transforms.prep.stages", "refinery.transforms.formats.warm_encoder")

EPILOG = """\
examples:
  refinery prep-mixture --config examples/mix.toml --data-root /tmp/mix --flow dev --max-tokens 200K --dry-run
  refinery prep-mixture --config mix.toml --flow research --stage pretrain --splits train,valid --workers 8
  refinery prep-mixture --config mix.toml --flow dev --continue-on-error --runner dataflow --project my-project ...

--dry-run prints the plan (sources, weights, token budgets, shards, and what the receipts
say is already done) and runs nothing. Re-run the same command to resume after a failure
or an interruption; --force re-does every source/split from scratch.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    g = parser.add_argument_group("mixture")
    g.add_argument("--config", required=True, metavar="TOML", help="mixture file ([mixtures.NAME] + sources)")
    g.add_argument("--flow", help="token target: dev (100M), research (1B), ablation (6B) or a [flows.X] "
                                  "of the file (default: the mixture's total_tokens_b)")
    g.add_argument("--stage", default="pretrain",
                   help="training stage whose mixture to prepare ([stages] of the file; default: pretrain)")
    g.add_argument("--mixture", metavar="NAME", help="mixture to prepare (overrides --stage)")
    g.add_argument("--splits", default="train,valid", help="comma-separated splits (default: train,valid)")
    g.add_argument("--data-root", metavar="DIR", help="output root, local or gs:// (default: data_root of the file)")
    g.add_argument("--max-tokens", metavar="N", help="cap on the total tokens over all sources (K, M, B, T)")
    g.add_argument("--valid-percent", type=float, default=1.0,
                   help="budget of a non-train split, in percent of the source's budget (default: 1)")
    g.add_argument("--num-shards", type=int, default=64, help="shards per source and split (default: 64)")
    add_tokenizer_args(parser)  # --tokenizer, --eos-token, --vocab-file: as prep's, for every source/split
    t = parser.add_argument_group("tokenizer checks")
    t.add_argument("--vocab-size", type=int, metavar="N", help="fail unless the tokenizer's vocab size is N")
    t.add_argument("--eos-token-id", type=int, metavar="ID", help="fail unless the tokenizer's EOS id is ID")
    r = parser.add_argument_group("run")
    r.add_argument("--continue-on-error", action="store_true",
                   help="a failing source/split does not stop the others (exit 1 at the end, naming it)")
    add_reject_rate_arg(r, "the rows read of a source/split (it then fails like one whose units fail)")
    r.add_argument("--parallel", action="store_true",
                   help="accepted for compatibility: --runner local already runs one worker per core")
    add_runner_args(parser)


# ---------------------------------------------------------------------------------------
# Input resolution (the hub is asked only here; fs/api are injectable for tests)
# ---------------------------------------------------------------------------------------

def hf_split_files(source: mx.Source, split: str, fs: Any = None, api: Any = None) -> tuple[HfSource, str]:
    """The :class:`HfSource` of a source's split, its files cut to the split's percent slice."""
    sl = source.hf_splits[split]
    assert source.hf_dataset is not None  # a source with hf_splits is an HF dataset's
    hf = resolve_hf_parquet(source.hf_dataset, source.hf_subset, sl.name, source.hf_revision, fs=fs, api=api)
    return replace(hf, files=tuple(sl.select(list(hf.files)))), str(sl)


def resolve_inputs(plan: mx.SplitPlan, fs: Any = None, api: Any = None, skipped: list[str] | None = None
                   ) -> tuple[list[storage.InputFile], dict[str, Any]]:
    """(input files, source description for the plan hash) of one source/split; the files of
    its folders skipped for their extension are appended to ``skipped``."""
    s = plan.source
    if s.is_hf:
        hf, spec = hf_split_files(s, plan.split, fs, api)
        return storage.expand_inputs(list(hf.files)), {**hf.describe(), "hf_split": spec}
    return storage.expand_inputs(list(s.path_splits[plan.split]), skipped=skipped), {}


def prep_config(plan: mx.SplitPlan, inputs: list[storage.InputFile], source_desc: dict[str, Any], num_shards: int,
                workers: int, tokenizer: TokenizerSpec | None = None, encoder: str = "fast") -> PrepConfig:
    """The :class:`PrepConfig` of one source/split."""
    return PrepConfig(inputs=inputs, output=plan.output, dataset=plan.source.id, num_shards=num_shards,
                      text_field=plan.source.text_field, text_template=plan.source.text_template,
                      id_field=plan.source.id_field,
                      max_tokens=plan.budget, wave_units=max(2, 2 * workers), source=source_desc,
                      tokenizer=tokenizer or DEFAULT, encoder=encoder)


def split_stages(plan: mx.SplitPlan, num_shards: int, workers: int, skipped: list[str] | None = None,
                 tokenizer: TokenizerSpec | None = None) -> tuple[PrepConfig, list[Stage[Any, Any]]]:
    """(prep config, prep stages) of one source/split: the resumable run :func:`_run_all` does
    for it (``refinery.runners.translate`` builds its Beam jobs without running them)."""
    inputs, desc = resolve_inputs(plan, skipped=skipped)
    cfg = prep_config(plan, inputs, desc, num_shards, workers, tokenizer)
    return cfg, build_stages(cfg)


def receipt_status(cfg: PrepConfig) -> tuple[str, str]:
    """(status, detail) of a source/split from its receipts: done (every unit of the final stages,
    pack and manifest, verifies) | partial | pending."""
    runs = bind_stages(build_stages(cfg), cfg.output)
    parts, any_done, final_pending = [], False, False
    for run in runs:
        units = run.stage.plan()
        done = sum(run.check(u.id).done for u in units)
        any_done |= done > 0
        parts.append(f"{run.name} {done}/{len(units)}")
        if run.traits.final_outputs and done < len(units):
            final_pending = True
    if not final_pending:  # what a run would still do is at most re-checking tokenize receipts
        return "done", "shards and manifest complete"
    return ("partial" if any_done else "pending"), ", ".join(parts)


# ---------------------------------------------------------------------------------------
# Command
# ---------------------------------------------------------------------------------------

def _fail(msg: str) -> NoReturn:
    raise UsageError(f"refinery prep-mixture: {msg}")


@dataclass(frozen=True)
class MixtureSettings:
    """``refinery prep-mixture``'s flags, read once from the command line."""

    config: str
    flow: str | None = None
    stage: str = "pretrain"
    mixture: str | None = None
    splits: str = "train,valid"
    data_root: str | None = None
    max_tokens: str | None = None
    valid_percent: float = 1.0
    num_shards: int = 64
    tokenizer: TokenizerFlags = TokenizerFlags()
    vocab_size: int | None = None
    eos_token_id: int | None = None
    continue_on_error: bool = False
    max_reject_rate: float | None = None
    run: RunFlags = RunFlags()


def settings_from_args(args: argparse.Namespace) -> MixtureSettings:
    """The :class:`MixtureSettings` of ``args`` (parsed by :func:`add_arguments`' parser)."""
    return MixtureSettings(
        config=args.config, flow=args.flow, stage=args.stage, mixture=args.mixture, splits=args.splits,
        data_root=args.data_root, max_tokens=args.max_tokens, valid_percent=args.valid_percent,
        num_shards=args.num_shards, tokenizer=TokenizerFlags.from_args(args), vocab_size=args.vocab_size,
        eos_token_id=args.eos_token_id, continue_on_error=args.continue_on_error,
        max_reject_rate=args.max_reject_rate, run=RunFlags.from_args(args))


@dataclass
class MixturePlan:
    """A checked prep-mixture run: its source/split runs, each source's weight, the tokenizer."""

    plans: list[mx.SplitPlan]
    weight_of: dict[str, int]
    tokenizer: TokenizerSpec


def run(args: argparse.Namespace, beam_args: list[str]) -> int:
    """Run (or dry run) every source/split; returns a process exit code."""
    s = settings_from_args(args)
    try:
        checked = checked_plan(s)
    except UsageError as e:
        return usage_error(str(e))
    workers = s.run.workers or os.cpu_count() or 1
    if s.run.dry_run:
        return _dry_run(checked, s, workers)
    return _run_all(checked, s, beam_args, workers)


def checked_plan(s: MixtureSettings) -> MixturePlan:
    """The runs of the mixture, every flag and output checked first; :class:`UsageError` (one
    line) for the first problem. Prints what it will prepare."""
    tokenizer = resolve_tokenizer_flags(s.tokenizer, "prep-mixture")
    if (s.vocab_size is not None and s.vocab_size != tokenizer.vocab_size
            or s.eos_token_id is not None and s.eos_token_id != tokenizer.eos_id):
        _fail(f"{tokenizer.name} has vocab size {tokenizer.vocab_size} and EOS {tokenizer.eos_id}; "
              f"got --vocab-size {s.vocab_size} --eos-token-id {s.eos_token_id}")
    if s.num_shards < 1:
        _fail("--num-shards must be at least 1")
    if problem := bad_reject_rate(s.max_reject_rate):
        _fail(problem)
    splits = [x.strip() for x in s.splits.split(",") if x.strip()]
    if not splits:
        _fail("--splits names no split")
    try:
        mf = mx.load_mixture_file(s.config)
        mixture = mx.select_mixture(mf, s.stage, s.mixture)
        target = mx.flow_target(mf, mixture, s.flow)
        max_tokens = parse_token_count(s.max_tokens) if s.max_tokens else None
        data_root = s.data_root or mf.data_root
        if not data_root:
            raise mx.MixtureError(f"{s.config}: no data_root in the file; pass --data-root DIR")
        plans, skipped = mx.plan_mixture(mixture, data_root, splits, target, max_tokens, s.valid_percent)
        weights = mx.fixed_point_weights(mx.source_fractions(mixture))
        for plan in plans:  # every output before any run: none may be a file, or inside an input
            check_output("prep-mixture", plan.output, [] if plan.source.is_hf else plan.source.path_splits[plan.split],
                         dry_run=s.run.dry_run, flag=f"the output of {plan.label}")
    except UsageError:
        raise
    except ValueError as e:
        _fail(str(e))
    effective = min(target, max_tokens) if max_tokens else target
    out = sys.stdout if s.run.dry_run else sys.stderr
    print(f"prep-mixture: mixture {mixture.name!r} ({s.config}), stage {s.stage}, flow {s.flow or '-'}: "
          f"{mx.format_tokens(effective)} tokens" + (f" (flow target {mx.format_tokens(target)}, "
                                                     f"capped by --max-tokens)" if effective < target else "")
          + f" over {len(mixture.sources)} source(s) -> {data_root}", file=out)
    for note in skipped:
        print(f"  skip {note}", file=out)
    return MixturePlan(plans, {src.id: w for src, w in zip(mixture.sources, weights)}, tokenizer)


def _dry_run(checked: MixturePlan, s: MixtureSettings, workers: int) -> int:
    """Print each source/split's plan and what its receipts say is done; run nothing."""
    plans, weight_of = checked.plans, checked.weight_of
    offline = storage.offline_state()  # the CLI's dry run: nothing remote is listed or read
    print(f"{'source/split':28} {'weight':>8} {'budget':>9} {'shards':>6}  {'status':8} detail")
    for plan in plans:
        try:
            unlisted = len(offline.unlisted) if offline else 0
            skipped: list[str] = []
            inputs, desc = resolve_inputs(plan, skipped=skipped)
            if offline and len(offline.unlisted) > unlisted:
                raise storage.RemoteNotRead(f"{', '.join(offline.unlisted[unlisted:])}: not listed ({offline.reason})")
            cfg = prep_config(plan, inputs, desc, s.num_shards, workers, checked.tokenizer, s.tokenizer.encoder)
            status, detail = receipt_status(cfg) if not s.run.force else ("pending", "--force: redo everything")
            detail = (f"{len(inputs)} file(s) from {plan.source.describe_split(plan.split)}; {detail}"
                      + (f"; {storage.skipped_note(skipped)}" if skipped else ""))
        except Exception as e:  # noqa: BLE001 - a dry run reports, it does not stop
            status, detail = "unresolved", f"{plan.source.describe_split(plan.split)}: {type(e).__name__}: {e}"
        print(f"{plan.label:28} {weight_of[plan.source.id] / mx.WEIGHT_SCALE:>8.4f} "
              f"{mx.format_tokens(plan.budget):>9} {s.num_shards:>6}  {status:8} {detail}")
        print(f"{'':28}   -> {plan.output}")
    print(f"dry run: {len(plans)} source/split run(s) planned, nothing was run", file=sys.stderr)
    return 0


def _run_all(checked: MixturePlan, s: MixtureSettings, beam_args: list[str], workers: int) -> int:
    """Run each source/split in turn; exit 1 naming the ones that failed."""
    plans = checked.plans
    failed: dict[str, str] = {}
    t0 = time.time()
    for i, plan in enumerate(plans, 1):
        print(f"[{i}/{len(plans)}] {plan.label}: budget {mx.format_tokens(plan.budget)} tokens -> {plan.output}",
              file=sys.stderr)
        try:
            skipped: list[str] = []
            cfg, stages = split_stages(plan, s.num_shards, workers, skipped, checked.tokenizer)
            if skipped:
                print(f"  {plan.label}: {storage.skipped_note(skipped)}", file=sys.stderr)
            result = run_stages(stages, cfg.output, beam_args, verify_checksums=s.run.verify_checksums,
                                force=s.run.force, progress=not s.run.no_progress,
                                run_info={"command": "prep-mixture", "argv": sys.argv[1:], "source": plan.source.id,
                                          "split": plan.split}, on_plan=clear_stale_manifest, runner=run_job)
            m = storage.read_json(storage.join(cfg.output, "manifest.json"))
            rows, rejects = m["rows"], storage.join(cfg.output, "rejects/rejects.jsonl")
            ran = ", ".join(f"{k} {v}" for k, v in result.ran.items()) or "nothing (already done)"
            print(f"  {plan.label}: {m['total_documents']:,} documents, {m['total_tokens']:,} tokens in "
                  f"{m['num_shards']} shards; units run: {ran}\n"
                  f"    rows: read {rows['read']:,} = accepted {rows['accepted']:,} + empty {rows['empty']:,} + "
                  f"rejected {rows['rejected']:,}"
                  + (f" + over budget {rows['over_budget']:,}" if rows.get("over_budget") else "")
                  + (f"  (reasons in {rejects})" if rows["rejected"] else ""), file=sys.stderr)
            failure = settle_prep_output("prep-mixture", cfg.output, s.max_reject_rate)  # prep's verdict
        except KeyboardInterrupt:
            raise
        except Exception as e:  # noqa: BLE001 - reported by name; the run goes on if asked to
            if interrupted():  # Beam wrapped the interruption
                raise
            failure = f"{type(e).__name__}: {e}"
        if failure:
            failed[plan.label] = failure
            print(f"  FAILED {plan.label}: {failed[plan.label]}", file=sys.stderr)
            if not s.continue_on_error:
                rest = [p.label for p in plans[i:]]
                print(f"refinery prep-mixture: stopped at {plan.label}" +
                      (f"; not run: {', '.join(rest)}" if rest else "") +
                      f" (--continue-on-error runs the others). Finished units are kept; resume with:\n"
                      f"  {resume_hint()}", file=sys.stderr)
                return 1
    done = len(plans) - len(failed)
    print(f"prep-mixture: {done}/{len(plans)} source/split(s) done in {time.time() - t0:.1f}s", file=sys.stderr)
    if failed:
        print("refinery prep-mixture: failed source/split(s):\n" +
              "\n".join(f"  {k}: {v.splitlines()[0]}" for k, v in failed.items()) +
              f"\nFinished work is kept; fix the cause and run the same command again:\n  {resume_hint()}",
              file=sys.stderr)
        return 1
    return 0
