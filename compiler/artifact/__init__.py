"""The artifact directory: staged and swapped into place (staging), inspected, exported to Triton."""
