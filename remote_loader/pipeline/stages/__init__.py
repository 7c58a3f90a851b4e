"""The stages a sample passes in a worker: decode, crop, collate, restore; threads for them."""
