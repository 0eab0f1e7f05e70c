import a_module_no_one_installed  # noqa: F401
