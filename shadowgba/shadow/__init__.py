"""The shadow runtime (`runtime.ShadowSync`): ma / easgd / bmuf / easgd_ps rounds in a background
thread or every k steps, with write-back and live control."""
