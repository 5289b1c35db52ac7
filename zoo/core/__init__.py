"""The core: what a part is (kinds), the registry and plugins that hold the parts, the spec tree,
the forward context and decode states, kernel dispatch and the precision policy. It imports nothing
else of zoo."""
