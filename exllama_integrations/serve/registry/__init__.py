"""The models a server serves: their entries (config), kinds and plans, memory, and the registry that loads them."""
