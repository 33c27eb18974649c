"""xmoe: giant Mixture-of-Experts models at about 2 bits per weight, in the EXL3 format."""
__version__ = "0.1.0"
