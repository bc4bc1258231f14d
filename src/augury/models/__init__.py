"""Model definitions (target family, EAGLE-3 head) and their strict loaders."""
