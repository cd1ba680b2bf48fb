"""The leaf every other package builds on: the token bitmask format, counter-based random
numbers, argument checks and host-to-device copies. Imports nothing from tandem."""
