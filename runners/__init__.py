"""refinery.runners."""
