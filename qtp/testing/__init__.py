"""Tools for tests and crash campaigns (a lossy HTTP proxy); applications do not need them."""
