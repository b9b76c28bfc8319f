"""``meshlm report``: one self-contained HTML page per set of runs (plots, pipeline timeline,
findings) and the pipeline timeline as a Chrome/Perfetto trace.

data.py reads a run directory; svg.py draws line charts; timeline.py draws the pipeline
timeline; trace.py writes the trace JSON; page.py assembles the HTML and is the command.
"""
