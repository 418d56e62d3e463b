"""refinery.transforms.decon."""
