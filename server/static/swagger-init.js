/* /docs: start Swagger UI on the server's OpenAPI document. A file, not an inline script:
 * the Content-Security-Policy (server/security.py) runs scripts from the server only. */
(function () {
  "use strict";
  window.ui = SwaggerUIBundle({
    url: "/openapi.json",
    dom_id: "#swagger-ui",
    layout: "BaseLayout",
    deepLinking: true,
    showExtensions: true,
    showCommonExtensions: true,
    presets: [SwaggerUIBundle.presets.apis, SwaggerUIBundle.SwaggerUIStandalonePreset],
  });
})();
