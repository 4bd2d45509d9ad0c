"""tritonkit inside other libraries' models (each submodule imports its library only when used)."""
