"""hvdtrain's tests, in tiers by folder; tests/support is what they import."""
