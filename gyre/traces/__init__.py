"""Trace formats: the rollout trace schema, readers for existing traces, and calibration."""
