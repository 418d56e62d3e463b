"""refinery.transforms.inference."""
