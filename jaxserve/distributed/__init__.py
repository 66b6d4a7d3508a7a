"""Multi-process (multi-host) building blocks below the engine and the runner."""
