"""meshgate: a proxy gateway into a private mesh network."""

__version__ = "0.1.0"
