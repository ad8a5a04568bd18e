"""Tools for tests and crash campaigns (such as a lossy HTTP proxy); applications do not need them."""
