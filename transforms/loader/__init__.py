"""refinery.transforms.loader."""
