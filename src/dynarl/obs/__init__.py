"""Observability: allocation timelines recorded from controller events, and plots."""
