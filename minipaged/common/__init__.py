"""What every stage shares: sampling parameters and outputs, logits processors, thread counts."""
