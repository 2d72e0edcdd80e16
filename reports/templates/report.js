// Optional enhancements: the page reads fully without JavaScript. Click a header to sort, type to filter; a long
// table shows its first rows and a button for the rest; a table wider than its box is stacked, one block per
// row; printing opens every fold.
(function () {
  document.documentElement.classList.add("js");  // done in the page's head already, before the tables
  var FIRST_ROWS = {{ first_rows }};
  function rows(table) { return Array.prototype.slice.call(table.tBodies[0].rows); }
  function cellValue(td) {
    var v = td.getAttribute("data-v");
    if (v !== null) { return v === "" ? null : parseFloat(v); }
    return td.textContent.trim().toLowerCase();
  }
  // long tables: rows past the first FIRST_ROWS (of those the filter keeps) wait for the buttons, which show the
  // next MORE_ROWS, all of them, or the first ones again (all of 25,000 rows take a browser half a minute to lay
  // out; the next few hundred, a blink)
  var MORE_ROWS = {{ more_rows }};
  function limit(table) { var n = parseFloat(table.getAttribute("data-shown")); return isNaN(n) ? FIRST_ROWS : n; }
  function collapse(table) {
    if (!table.classList.contains("long")) { return; }
    var all = rows(table), kept = 0, inputs = 0, shown = limit(table);
    all.forEach(function (r) {
      if (r.style.display === "none") { r.classList.remove("extra"); return; }
      kept += 1;
      if (r.classList.contains("layer-input")) { inputs += 1; }
      r.classList.toggle("extra", kept > shown);
    });
    var box = table.parentNode.nextElementSibling;
    if (!box || !box.classList.contains("more-rows")) { return; }
    var more = box.querySelector(".next"), rest = box.querySelector(".rest"), open = kept <= shown;
    box.hidden = kept <= FIRST_ROWS;
    more.hidden = open || kept - shown <= MORE_ROWS;
    more.textContent = "Show the next " + MORE_ROWS.toLocaleString("en-US") + " rows";
    rest.textContent = open ? "Show the first " + FIRST_ROWS + " rows" : "Show all " + kept.toLocaleString("en-US") + " rows" + ofWhat(kept, inputs);
    rest.setAttribute("data-open", open ? "1" : "0");
  }
  // the per-layer table's rows of modules' inputs are no layers (the header's "layers profiled" leaves them out):
  // the rows said as layers and inputs, so that the two counts add up
  function ofWhat(kept, inputs) {
    if (!inputs) { return ""; }
    var layers = kept - inputs;
    return " (" + layers.toLocaleString("en-US") + (layers === 1 ? " layer" : " layers") + " and " +
      inputs.toLocaleString("en-US") + " of their inputs)";
  }
  function button(cls, onclick) {
    var b = document.createElement("button");
    b.type = "button";
    b.className = cls;
    b.addEventListener("click", onclick);
    return b;
  }
  document.querySelectorAll("table.long").forEach(function (table) {
    if (rows(table).length <= FIRST_ROWS) { return; }
    var box = document.createElement("div");
    box.className = "more-rows";
    box.appendChild(button("next", function () {
      table.setAttribute("data-shown", String(limit(table) + MORE_ROWS));
      collapse(table);
    }));
    var rest = button("rest", function () {
      table.setAttribute("data-shown", rest.getAttribute("data-open") === "1" ? String(FIRST_ROWS) : "Infinity");
      collapse(table);
    });
    box.appendChild(rest);
    table.parentNode.parentNode.insertBefore(box, table.parentNode.nextSibling);
    collapse(table);
  });
  document.querySelectorAll("table.sortable").forEach(function (table) {
    var headers = table.querySelectorAll("thead th");
    headers.forEach(function (th, col) {
      th.addEventListener("click", function () {
        var asc = th.getAttribute("aria-sort") !== "ascending";
        headers.forEach(function (h) { h.removeAttribute("aria-sort"); });
        th.setAttribute("aria-sort", asc ? "ascending" : "descending");
        var body = table.tBodies[0];
        var sorted = rows(table);
        sorted.sort(function (a, b) {
          var x = cellValue(a.cells[col]), y = cellValue(b.cells[col]);
          if (x === null && y === null) { return 0; }
          if (x === null) { return 1; }
          if (y === null) { return -1; }
          var c = (typeof x === "number" && typeof y === "number") ? x - y : String(x).localeCompare(String(y));
          return asc ? c : -c;
        });
        sorted.forEach(function (r) { body.appendChild(r); });
        collapse(table);
      });
    });
  });
  // filter: a query with a "." or a digit that is whole parts of a module's dotted name keeps the rows of the
  // modules it names that way, "layers.4" layers.4, layers.4.attn and layers.4:input, not layers.40 to 47 (nor
  // "h.1" transformer.h.12); any other query ("c_at", "linear", "bfloat16", and a type word that also names a
  // module, "norm" with Llama's model.norm, "mlp", "dropout") keeps the rows whose text holds it
  function moduleOf(r) {
    var c = r.querySelector("td.mod code");
    return c ? c.textContent.trim().toLowerCase() : "";
  }
  function names(name, q) {
    for (var at = name.indexOf(q); at >= 0; at = name.indexOf(q, at + 1)) {
      var after = name.charAt(at + q.length);
      if ((at === 0 || name.charAt(at - 1) === ".") && (after === "" || after === "." || after === ":")) {
        return true;
      }
    }
    return false;
  }
  document.querySelectorAll("input.filter").forEach(function (input) {
    var table = document.getElementById(input.getAttribute("data-table"));
    if (!table) { return; }
    input.addEventListener("input", function () {
      var q = input.value.trim().toLowerCase(), all = rows(table);
      var byName = /[.0-9]/.test(q) && all.some(function (r) { return names(moduleOf(r), q); });
      all.forEach(function (r) {
        var keep = !q || (byName ? names(moduleOf(r), q) : r.textContent.toLowerCase().indexOf(q) >= 0);
        r.style.display = keep ? "" : "none";
      });
      collapse(table);
    });
  });
  // a table wider than its box: one block per row, each value under its column's name
  function fit() {
    document.querySelectorAll("table.stackable").forEach(function (table) {
      table.classList.remove("stacked");
      var box = table.parentNode;
      if (box.scrollWidth > box.clientWidth + 1) { table.classList.add("stacked"); }
    });
  }
  var pending = null;
  window.addEventListener("resize", function () {
    if (pending) { clearTimeout(pending); }
    pending = setTimeout(fit, 100);
  });
  fit();
  // print: every fold open (the rows of long tables print by the stylesheet), folds restored after
  var opened = [];
  window.addEventListener("beforeprint", function () {
    opened = Array.prototype.filter.call(document.querySelectorAll("details"), function (d) { return !d.open; });
    opened.forEach(function (d) { d.open = true; });
  });
  window.addEventListener("afterprint", function () { opened.forEach(function (d) { d.open = false; }); });
})();
