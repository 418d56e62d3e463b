"""refinery.transforms.formats."""
