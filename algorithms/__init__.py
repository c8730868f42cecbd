"""Per-algorithm maths that a strategy and its learner share (both import it, never each other)."""
