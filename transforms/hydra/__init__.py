"""refinery.transforms.hydra."""
