"""Between the parsed configuration and the built objects: every ``auto`` or unset memory and engine setting is made
concrete on the config, once, before any class is built (``resolve``), from the memory plan (``memory_plan``)."""
