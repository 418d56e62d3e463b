"""refinery.transforms.prep."""
