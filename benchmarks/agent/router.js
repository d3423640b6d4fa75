// A tiny HTTP router: routes by method and path, with path parameters.
class Router {
  constructor() {
    this.routes = [];
  }

  add(method, pattern, handler) {
    const keys = [];
    const regex = new RegExp(
      "^" + pattern.replace(/:(\w+)/g, (_, key) => {
        keys.push(key);
        return "([^/]+)";
      }) + "$"
    );
    this.routes.push({ method, regex, keys, handler });
  }

  get(pattern, handler) {
    this.add("GET", pattern, handler);
  }

  post(pattern, handler) {
    this.add("POST", pattern, handler);
  }

  match(method, path) {
    for (const route of this.routes) {
      if (route.method !== method) continue;
      const found = route.regex.exec(path);
      if (!found) continue;
      const params = {};
      route.keys.forEach((key, i) => {
        params[key] = decodeURIComponent(found[i + 1]);
      });
      return { handler: route.handler, params };
    }
    return null;
  }

  handle(request) {
    const found = this.match(request.method, request.path);
    if (!found) return { status: 404, body: "not found" };
    return found.handler({ ...request, params: found.params });
  }
}

module.exports = { Router };
