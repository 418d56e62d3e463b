"""refinery's transforms in your own Beam pipeline: Parquet -> token shards, and train/test overlap.

    python examples/beam_pipeline.py --parquet 'corpus/*.parquet' --eval eval.jsonl --output out/
    # any Beam flag works too, e.g. for Dataflow:
    #   --runner DataflowRunner --project my-project --region us-central1 --temp_location gs://my-bucket/tmp
"""
from __future__ import annotations

import argparse
import json

import apache_beam as beam
from apache_beam.options.pipeline_options import PipelineOptions

from refinery.transforms.decon import BuildNgramIndex, FindOverlaps
from refinery.transforms.prep import AssignShard, Normalize, Tokenize, WriteTokenShards


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parquet", required=True, help="Parquet files with 'id' and 'text' columns")
    ap.add_argument("--eval", required=True, help="JSONL eval set with 'id' and 'question' fields")
    ap.add_argument("--output", required=True)
    ap.add_argument("--num-shards", type=int, default=4)
    args, beam_args = ap.parse_known_args(argv)

    with beam.Pipeline(options=PipelineOptions(beam_args)) as p:
        rows = p | "ReadParquet" >> beam.io.ReadFromParquet(args.parquet)

        # prep: rows -> Documents -> token ids -> (shard, doc) -> .npy/.idx shards + manifest.json
        docs, rejected = rows | Normalize(text_field="text", id_field="id").with_rejected()
        _ = (docs
             | Tokenize()
             | AssignShard(args.num_shards)
             | WriteTokenShards(f"{args.output}/shards", dataset="web", num_shards=args.num_shards,
                                rejected=rejected))

        # decon: the eval set's 13-gram index, joined with the training rows as a side input
        index = (p
                 | "ReadEval" >> beam.io.ReadFromText(args.eval)
                 | "ParseEval" >> beam.Map(json.loads)
                 | BuildNgramIndex(ngrams=[13], eval_dataset="gsm8k", text_field="question"))
        _ = (rows
             | FindOverlaps(index)
             | "ToJson" >> beam.Map(lambda o: json.dumps(o._asdict()))
             | "WriteOverlaps" >> beam.io.WriteToText(f"{args.output}/overlaps", file_name_suffix=".jsonl"))


if __name__ == "__main__":
    main()
