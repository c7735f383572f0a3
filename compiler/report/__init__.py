"""report.json and report.html, read back from an artifact's own files (collect), rendered (html, plots)."""
