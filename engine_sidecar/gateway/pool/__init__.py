"""Pool-wide admission on a shared store, for what one engine's view cannot see."""
