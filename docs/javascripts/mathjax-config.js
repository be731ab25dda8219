// MathJax 2, served from the site itself (assets/mathjax, from jupyter-server-mathjax):
// TeX in, HTML-CSS out with the bundled STIX-Web fonts; nothing is fetched from elsewhere.
// Markdown pages hold \( \) and \[ \] (pymdownx.arithmatex); notebook pages hold $ and $$.
window.MathJax = {
  config: ["TeX-AMS-MML_HTMLorMML-full.js"],
  TeX: { extensions: ["AMSmath.js", "AMSsymbols.js", "noErrors.js", "noUndefined.js"] },
  tex2jax: {
    inlineMath: [["\\(", "\\)"], ["$", "$"]],
    displayMath: [["\\[", "\\]"], ["$$", "$$"]],
    processEscapes: true,
    ignoreClass: "tex2jax_ignore|md-header|md-nav|md-footer|md-search|md-source",
  },
  "HTML-CSS": { availableFonts: [], preferredFont: null, webFont: "STIX-Web", imageFont: null },
  MMLorHTML: { prefer: "HTML" },
  showMathMenu: false,
  messageStyle: "none",
};
