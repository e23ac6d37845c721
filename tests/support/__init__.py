"""Support shared by several test folders (imported as `support.<module>`; the suite's
root conftest puts tests/ on sys.path). Nothing here is a test."""
