"""refinery.beam_pipelines."""
