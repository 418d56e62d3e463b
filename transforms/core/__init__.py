"""refinery.transforms.core."""
