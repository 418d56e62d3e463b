"""refinery.transforms.io."""
