"""Report templates (shipped as package data)."""
