"""refinery.transforms."""
