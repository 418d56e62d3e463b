"""refinery.transforms.clean: a decontaminated copy of training files in their own format
(``refinery clean``)."""
