// Keyboard shortcuts for the rating form, and one submit per page: a double press posts once
// (the server records a repeated identical answer once anyway). The guidelines are open on the
// first item of a browser session and collapsed after (one click opens them); the conversation
// opens scrolled to its last human turn, the one both responses answer.
(function () {
  "use strict";
  var form = document.getElementById("rate-form");
  if (!form) { return; }
  var guidelines = document.getElementById("guidelines-box");
  try {
    if (window.sessionStorage.getItem("forge-guidelines-seen")) { guidelines.open = false; }
    window.sessionStorage.setItem("forge-guidelines-seen", "1");
  } catch (ignored) { /* storage off: the guidelines stay open */ }
  var prompt = document.getElementById("prompt");
  var box = document.getElementById("prompt-box");
  var text = prompt.textContent;
  var at = text.lastIndexOf("Human:");
  if (at > 0) {
    var last = document.createElement("span");
    last.id = "last-turn";
    last.textContent = text.slice(at);
    prompt.textContent = text.slice(0, at);
    prompt.appendChild(last);
    box.scrollTop = last.offsetTop;
  }
  var keys = { "1": "choose-a", "a": "choose-a", "2": "choose-b", "b": "choose-b",
               "3": "choose-tie", "t": "choose-tie", "4": "choose-both-bad", "x": "choose-both-bad" };
  var sent = false;
  form.addEventListener("submit", function (event) {
    if (sent) { event.preventDefault(); return; }
    sent = true;
    // Disable after the browser has read the pressed button's value into the form data.
    setTimeout(function () {
      form.querySelectorAll("button").forEach(function (b) { b.disabled = true; });
    }, 0);
  });
  document.addEventListener("keydown", function (event) {
    if (event.ctrlKey || event.metaKey || event.altKey) { return; }
    var target = event.target;
    if (target && (target.tagName === "TEXTAREA" || target.tagName === "INPUT")) {
      if (event.key === "Escape") { target.blur(); }
      return;
    }
    var key = event.key.toLowerCase();
    if (key === "r") { event.preventDefault(); document.getElementById("reason").focus(); return; }
    var id = keys[key];
    if (id) {
      event.preventDefault();
      var button = document.getElementById(id);
      if (!sent) { form.requestSubmit(button); }
    }
  });
})();
