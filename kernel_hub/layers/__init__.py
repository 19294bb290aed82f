"""Load-time layer replacement (``kernelize``), its modes and report, and the integrations with
model libraries (``integrations/``)."""
