"""The foundation: maths, services (storage, tracking, registry, exports, distributed), models and rewards.

Imports only point down: nothing here imports ``stages`` or ``pipeline``."""
